"""Multimodal chat models loaded from standard checkpoints: vision-language (LLaVA, Qwen2-VL, Qwen2.5-VL) and
audio-language (Qwen2-Audio).

A request's way: content parts are checked (chat_parts) -> sources fetched (Engine.asubmit_chat) -> the
graph: media_decode (`decode_chat_media` in the media workers, then `generation_request_with_media`: the chat
template renders one placeholder per image / video / audio clip, each placeholder is expanded to the item's
feature length (planned from its size or duration), the prompt is checked against the context with the media
tokens counted) -> vision_encode and/or audio_encode -> llm, which reads them all (the prompt from media_decode,
the features from the encoders).

The model is loaded once: its vision tower (or audio encoder) and projector serve the encoder adapters, its
language model (paged attention) serves the runner.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from encoders.audio import AudioAdapter
from encoders.cache import EncoderCache
from encoders.vision import ADAPTERS, AUDIO_ADAPTERS, EncoderAdapter, EncodeTask, MediaItem, adapter_class
from pipelines.chat import ChatRequest, LanguageModel, LLMConfig
from pipelines.chat_parts import MediaPart, ParsedChat, VLMConfig, parse_messages
from pipelines.config import MediaConfig
from pipelines.image_request import RequestError
from stages.llm import attention
from stages.llm.multimodal import MediaSpan, MRoPE
from stages.llm.runner import DTYPES, ModelRunner
from stages.llm.stage import GenerationRequest
from stages.media.stage import result_of
from stages.metrics import Metrics
from stages.vision import AudioEncodeStage, VisionEncodeStage

if TYPE_CHECKING:
    from pipelines.omni import OmniVoice
    from pipelines.omni3 import Omni3Voice

VLM_FAMILY = "vlm"
# Architectures whose chat runs on a part of the checkpoint: Qwen2.5-Omni's and Qwen3-Omni's thinkers (text out).
LOAD_AS = {"Qwen2_5OmniForConditionalGeneration": "Qwen2_5OmniThinkerForConditionalGeneration",
           "Qwen3OmniMoeForConditionalGeneration": "Qwen3OmniMoeThinkerForConditionalGeneration"}
# ... and whose talker speaks the reply: architecture -> "module:Class" of its voice (talker and codec decoder)
SPEAKING = {"Qwen2_5OmniForConditionalGeneration": "pipelines.omni:OmniVoice",
            "Qwen3OmniMoeForConditionalGeneration": "pipelines.omni3:Omni3Voice"}


class VLMChatModel(LanguageModel):
    """A loaded multimodal chat model: processor + chat template, its encoder adapters (vision, audio) and their
    stages, the runner and the llm stage."""

    def __init__(self, name: str, path: str, *, device: str, dtype: str, config: LLMConfig, vlm: VLMConfig,
                 metrics: Metrics, cache: EncoderCache):
        import torch
        import transformers

        self.vlm = vlm
        self.processor = transformers.AutoProcessor.from_pretrained(path)
        checkpoint = transformers.AutoConfig.from_pretrained(path)
        architecture = _architecture(checkpoint, path)
        cls = getattr(transformers, LOAD_AS.get(architecture, architecture))
        # Paged attention for the language model only; the encoders keep their default attention.
        model = cls.from_pretrained(path, dtype=DTYPES[dtype],
                                    attn_implementation={"text_config": attention.register()})
        model.to(device).eval()
        weights_id = f"{VLM_FAMILY}:{path}:{_fingerprint(path, model)}"
        options: dict[str, Any] = dict(weights_id=weights_id, dtype=DTYPES[dtype], device=torch.device(device),
                                       low_detail_max_pixels=vlm.low_detail_max_pixels)
        # kind ("image", "video", "audio") -> the adapter that encodes it; node name -> its stage
        self.adapters: dict[str, EncoderAdapter] = {}
        self.encode_stages: dict[str, VisionEncodeStage] = {}
        for audio, stage_cls in ((False, VisionEncodeStage), (True, AudioEncodeStage)):
            adapter_cls = adapter_class(architecture, audio=audio)
            if adapter_cls is None:
                continue
            adapter = adapter_cls(model, self.processor, **options)
            kinds = [*adapter.token_ids, *(["video"] if adapter.video_as_images else [])]
            self.adapters.update({kind: adapter for kind in kinds})
            self.encode_stages[stage_cls.kind] = stage_cls(name, adapter, cache, metrics, vlm.max_items_per_forward)
        if not self.adapters:
            raise ValueError(f"no vision or audio adapter for {architecture!r}; supported: "
                             f"{sorted({**ADAPTERS, **AUDIO_ADAPTERS})}")
        self.mrope = next((a for a in self.adapters.values() if a.uses_mrope), None)
        self.voice: OmniVoice | Omni3Voice | None = None  # an omni model's talker and codec decoder: it can speak
        if architecture in SPEAKING and getattr(checkpoint, "enable_audio_output", False):
            module, voice_cls = SPEAKING[architecture].split(":")
            self.voice = getattr(importlib.import_module(module), voice_cls)(path, model, device=device,
                                                                              dtype=DTYPES[dtype])
        runner = ModelRunner(path, device=device, dtype=dtype, block_size=config.block_size,
                             kv_cache_mb=config.kv_cache_mb, model=model, decoder=model.model.language_model,
                             mrope=self.mrope is not None)
        super().__init__(name, self.processor.tokenizer, runner, weights_id, config, metrics)

    @property
    def accepts(self) -> tuple[str, ...]:
        """The media kinds this model reads ("image", "video", "audio")."""
        return tuple(self.adapters)

    @property
    def token_ids(self) -> dict[str, int]:
        return {kind: token for adapter in self.adapters.values() for kind, token in adapter.token_ids.items()}

    # -- text-only requests (LanguageModel.generation_request) ------------------------------------------
    def _chat_ids(self, raw_messages: list, tools=None) -> list[int]:
        if tools is not None:
            raise RequestError("tools", f"model {self.name} does not take tools yet (text chat models do)")
        parsed = parse_messages(raw_messages, self.vlm, self.accepts, self.name)
        if parsed.media:
            raise RequestError("messages", "requests with media parts go through Engine.asubmit_chat")
        return self._render(parsed, [])

    def _checked_ids(self, ids: list[int], param: str) -> tuple[int, ...]:
        if set(ids) & set(self.token_ids.values()):  # a placeholder without features: refuse, never guess
            raise RequestError(param, "the prompt holds the model's media placeholder token but no media part")
        return super()._checked_ids(ids, param)

    # -- multimodal requests --------------------------------------------------------------------------
    def max_audio_s(self, media: MediaConfig) -> float:
        """The longest audio part a request may bring: the media limit, vlm.max_audio_s and the encoder's window."""
        adapter = self.adapters["audio"]
        assert isinstance(adapter, AudioAdapter)  # the "audio" kind is an audio adapter's
        return min(media.audio.max_duration_s, self.vlm.max_audio_s, adapter.max_seconds)

    def parse(self, request: ChatRequest) -> ParsedChat:
        """Sampling parameters, content parts and media limits; the text alone must fit the context (before any
        fetch)."""
        self.check_params(request)
        parsed = parse_messages(request.messages, self.vlm, self.accepts, self.name)
        text_tokens = len(self._render(parsed, [[] for _ in parsed.media]))
        if text_tokens >= self.runner.max_context:
            raise RequestError("messages", f"the text alone is {text_tokens} tokens; this model's context is "
                               f"{self.runner.max_context} tokens", code="context_length_exceeded")
        return parsed

    def generation_request_with_media(self, request: ChatRequest, parsed: ParsedChat, media: list[list[MediaItem]]
                                      ) -> tuple[GenerationRequest, dict[str, tuple[EncodeTask, ...]]]:
        """Render, expand the placeholders to each item's feature length, check the context: what will run, and
        each encoder node's tasks (in prompt order).

        `media[i]` holds the decoded items of parsed.media[i] (a video is one item, or its frames for models
        that take videos as images).
        """
        # 1. plan every item: geometry (token count) and cache identity, from sizes alone
        queues: dict[str, collections.deque[EncodeTask]] = {kind: collections.deque() for kind in self.token_ids}
        for part, items in zip(parsed.media, media, strict=True):
            for item in items:
                try:
                    queues[item.kind].append(self.adapters[item.kind].task(item, request.tenant))
                except ValueError as e:
                    raise RequestError(part.param, str(e), code="invalid_media") from None
        # 2. render the template (one placeholder per item), then expand each placeholder in place
        ids = self._render(parsed, media)
        kinds = {token: kind for kind, token in self.token_ids.items()}
        prompt: list[int] = []
        spans: list[MediaSpan] = []
        tasks: list[EncodeTask] = []
        for token in ids:
            kind = kinds.get(token)
            if kind is None:
                prompt.append(token)
                continue
            if not queues[kind]:
                raise RequestError("messages", f"the prompt holds more {kind} placeholder tokens than {kind} items: "
                                   "message text must not contain the model's media placeholder tokens")
            task = queues[kind].popleft()
            spans.append(MediaSpan(len(prompt), task.geometry.num_tokens, task.identity, audio=kind == "audio"))
            tasks.append(task)
            prompt += [token] * task.geometry.num_tokens
        if any(queues.values()):
            raise RequestError("messages", f"model {self.name}'s chat template did not place every media item")
        # 3. the context must hold the text and every media token
        media_tokens = sum(s.length for s in spans)
        if len(prompt) >= self.runner.max_context:
            raise RequestError("messages", f"the prompt is {len(prompt)} tokens ({media_tokens} of them for images, "
                               f"video and audio); this model's context is {self.runner.max_context} tokens",
                               code="context_length_exceeded")
        mrope = None
        if self.mrope is not None and tasks:
            rope = self.mrope.rope_positions(prompt, [t.geometry for t in tasks])
            assert rope is not None  # an M-RoPE adapter gives the positions
            positions, delta = rope
            mrope = MRoPE(positions, delta)
        # Tokens after a media span depend on it: the prefix-cache namespace carries every media identity.
        namespace = (self.weights_id, None, request.tenant, tuple(t.identity for t in tasks))
        by_node = {kind: tuple(t for t in tasks if (t.geometry.kind == "audio") == (kind == "audio_encode"))
                   for kind in self.encode_stages}
        return GenerationRequest(tuple(prompt), request.params, namespace, tuple(spans), mrope,
                                 keep_hidden=request.speech is not None, stream=request.stream), \
            {kind: found for kind, found in by_node.items() if found}

    def _render(self, parsed: ParsedChat, media: list[list[MediaItem]]) -> list[int]:
        """The chat template's token ids, with one placeholder token per media item."""
        messages = []
        for message in parsed.messages:
            content = message["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part["type"] == "text":
                        parts.append(part)
                    else:
                        parts += [{"type": item.kind} for item in media[part["index"]]]
                content = parts
            messages.append({"role": message["role"], "content": content})
        renderer = self.processor if self.processor.chat_template else self.tokenizer
        if not renderer.chat_template:
            raise RequestError("messages", f"model {self.name} has no chat template; use /v1/completions")
        text = renderer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str)  # tokenize=False: the rendered text of one conversation
        return self._tokenize(text, "messages", add_special_tokens=False)  # refused unread when far too long


@dataclass(frozen=True)
class DecodeChatMedia:
    """The media_decode task of a chat with media: its parsed messages and each part's fetched bytes."""

    parsed: ParsedChat
    sources: tuple[bytes, ...]  # parsed.media[i]'s bytes

    def __repr__(self) -> str:  # never the bytes in a log line
        return f"DecodeChatMedia({len(self.sources)} parts, {sum(map(len, self.sources))} bytes)"


def decode_chat_media(model: VLMChatModel, media: MediaConfig):
    """The decode of a chat's media in the media workers: every image and audio decode and video probe in flight at
    once (audio resampled to the encoder's rate, its length within vlm.max_audio_s and the encoder's window, an
    input_audio's container the format it declares), then each video sampled (by fps, or num_frames when that
    would pass the limit) and decoded. A video becomes
    one item, or one image item per sampled frame for models that take videos as images."""
    def submit_first(pool, part: MediaPart, data: bytes):
        if part.kind == "image":
            return pool.submit("decode_image", data, media.image)
        if part.kind == "audio":
            adapter = model.adapters["audio"]
            assert isinstance(adapter, AudioAdapter)
            limits = dataclasses.replace(media.audio, max_duration_s=model.max_audio_s(media),
                                         formats=(part.audio_format,) if part.audio_format else media.audio.formats)
            return pool.submit("decode_audio", data, limits, sample_rate=adapter.sample_rate)
        return pool.submit("probe_video", data, media.video)

    def decode(pool, task: DecodeChatMedia) -> tuple[ParsedChat, list[list[MediaItem]]]:
        parts = task.parsed.media
        first = [submit_first(pool, part, data) for part, data in zip(parts, task.sources)]
        videos = {}
        for i, (part, data) in enumerate(zip(parts, task.sources)):
            if part.kind == "video":
                info = result_of(first[i], part.param)
                fps = part.fps or model.vlm.default_video_fps
                max_frames = min(part.max_frames or model.vlm.max_video_frames, model.vlm.max_video_frames)
                fits = math.ceil(info.duration_s * fps - 1e-6) <= max_frames
                sampling = {"fps": fps} if fits else {"num_frames": max_frames}
                videos[i] = pool.submit("decode_video", data, media.video, **sampling)
        out = []
        for i, part in enumerate(parts):
            if part.kind == "audio":
                audio = result_of(first[i], part.param)
                out.append([MediaItem("audio", audio.samples, audio.content_hash, 0, 0)])
                continue
            if part.kind == "image":
                image = result_of(first[i], part.param)
                out.append([MediaItem("image", image.to_pil(), image.content_hash, image.height, image.width,
                                      detail=part.detail)])
                continue
            video = result_of(videos[i], part.param)
            if model.adapters["video"].video_as_images:
                from encoders.llava import frame_images

                out.append([MediaItem("image", frame, f"{video.content_hash}#frame{k}", video.height, video.width)
                            for k, frame in enumerate(frame_images(video.frames))])
            else:
                out.append([MediaItem("video", video.frames, video.content_hash, video.height, video.width,
                                      fps=video.fps, frame_count=video.frame_count, indices=tuple(video.indices))])
        return task.parsed, out
    return decode


def _architecture(config, path: str) -> str:
    architectures = config.architectures or []
    if not architectures:
        raise ValueError(f"{path}: config.json names no architectures")
    return architectures[0]


def _fingerprint(path: str, model) -> str:
    """Identity of the weights at `path`: file names, sizes and modification times (hub: the commit)."""
    root = Path(path)
    if not root.is_dir():
        return str(getattr(model.config, "_commit_hash", None) or "hub")
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".bin", ".json"):
            st = f.stat()
            h.update(json.dumps([str(f.relative_to(root)), st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()[:16]
