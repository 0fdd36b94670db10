"""Qwen3-Omni's speech half: the talker (codec code 0 of each frame from the thinker's reply, its code predictor the
other code groups) and code2wav (a causal codec decoder to 24 kHz audio), as the `talker` and `code2wav` stages after
the thinker's llm node.

What the talker reads (`Qwen3OmniMoeForConditionalGeneration.generate`): the user turns of the prompt (text
positions: the thinker's input embedding through `text_projection`; media positions: the thinker's hidden state
after `accept_hidden_layer` layers through `hidden_projection`), then the reply's start (its first tokens, the
speaker's codec id, the codec's think / pad / bos ids), then one reply token a step (then text-end, then text-pad).
The only thinker states it needs are at media placeholders, so for a prompt with media the talker stage recomputes
the prompt up to its last placeholder through those layers (`media_hidden`: the thinker's own layers over a paged
cache of its own; the llm stage keeps last-layer states only); a text prompt needs none.

Each reply runs transformers' own talker `generate()` (its code predictor inside) on those inputs, with the global
generator set to the request's seed for the call (`seeded_stream`): one seed gives `generate()`'s codes after
`torch.manual_seed(seed)`, as the thinker's greedy reply draws nothing. Replies are not batched with each other yet
(one talker call each; code2wav one reply a call) and not streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from pipelines.omni import seeded_stream
from stages.llm import attention
from stages.llm.multimodal import MediaSpan, attach_features, in_span_order, mrope_positions, splice
from stages.llm.stage import GenerationRequest
from stages.pool import PoolConfig
from stages.stage import Stage, WorkItem

SAMPLE_RATE = 24000  # code2wav's output
CODE2WAV_POOL = PoolConfig(max_batch_size=1, max_queue=256)  # one reply a call (a default: ModelSpec.pools rules)


@dataclass(frozen=True)
class Talker3Job:
    """One reply for the talker: the thinker's prompt and reply ids, its states at the prompt's media placeholders,
    the media's geometry (the talker's rope index reads it), the speaker and the seed."""

    prompt_ids: list[int]
    reply_ids: list[int]
    media_hidden: torch.Tensor | None  # [media placeholders, H]: after accept_hidden_layer layers; None: no media
    audio_frames: tuple[int, ...]  # mel frames of each audio clip, in prompt order
    image_grids: tuple[tuple[int, int, int], ...]  # (t, h, w) patches of each image, in prompt order
    speaker: str
    seed: int


class Omni3Voice:
    """The talker (with its code predictor), code2wav and speakers of a Qwen3-Omni checkpoint, beside a thinker
    loaded elsewhere (whose embeddings and first layers the talker's inputs come from)."""

    def __init__(self, path: str, thinker, *, device: str, dtype: torch.dtype = torch.float32):
        from transformers import Qwen3OmniMoeForConditionalGeneration

        # The whole checkpoint loads once more (its thinker copy is dropped below: a transient second thinker).
        full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype)
        if not full.has_talker:
            raise ValueError(f"{path}: this Qwen3-Omni checkpoint has no talker (enable_audio_output is off)")
        self.talker = full.talker.to(device).eval()
        self.code2wav = full.code2wav.to(device).eval()
        config: Any = full.config  # its sub-configs are typed as unions
        self.config = config  # the whole model's: role, tts and codec token ids
        # transformers 5.25's talker rope index reads `config.audio_config.n_window` from the talker's config, which
        # has none (a prompt with audio fails in generate()): it is the thinker's audio encoder's, set once at load.
        talker_config: Any = self.talker.config
        talker_config.audio_config = config.thinker_config.audio_config
        del full
        self.thinker = thinker
        self.device = torch.device(device)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.config.talker_config.speaker_id)

    @torch.inference_mode()
    def media_hidden(self, request: GenerationRequest, spans: tuple[MediaSpan, ...]) -> torch.Tensor:
        """The thinker's hidden states after `accept_hidden_layer` layers at every media placeholder of the prompt
        [placeholders, H]: the prompt up to its last placeholder (features spliced in, its 3-D positions) through
        the thinker's own layers, attending over a paged cache of this call's own. After all the layers,
        transformers' state is the normed one: so is this."""
        lm = self.thinker.model.language_model
        depth = self.config.talker_config.accept_hidden_layer
        where = [p for span in spans for p in range(span.offset, span.end)]
        end = max(where) + 1
        dev = lm.embed_tokens.weight.device
        embeds = self.thinker.get_input_embeddings()(torch.tensor(request.prompt_ids[:end], device=dev))
        splice(embeds, 0, 0, end, spans)
        positions = mrope_positions(request.mrope, 0, end)[:, None].to(dev)  # [3, 1, T]
        text = lm.config
        shape = (1, end, text.num_key_value_heads, text.head_dim)  # one block holding the whole prefix
        caches = [torch.zeros(shape, dtype=embeds.dtype, device=dev) for _ in range(2 * min(depth, len(lm.layers)))]
        meta = attention.PagedMetadata(
            k_caches=caches[0::2], v_caches=caches[1::2], slot_mapping=torch.arange(end, device=dev),
            query_start_loc=torch.tensor([0, end], device=dev), context_lens=torch.tensor([end], device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.long, device=dev), all_decode=end == 1, max_query_len=end)
        hidden = embeds[None]
        rotary = lm.rotary_emb(hidden, positions)
        for layer in lm.layers[:depth]:
            hidden = layer(hidden, attention_mask=None, position_ids=None, position_embeddings=rotary, paged=meta)
        if depth >= len(lm.layers):
            hidden = lm.norm(hidden)
        return hidden[0, where]

    def talker_inputs(self, job: Talker3Job) -> dict[str, Any]:
        """`generate()`'s talker inputs for one reply (its batch of one): the user turns (text and media rows), the
        reply's start, the rest of the reply a step at a time, and the media geometry for the talker's rope index."""
        config, talker = self.config, self.talker
        codec = config.talker_config
        embed = self.thinker.get_input_embeddings()
        dev = embed.weight.device
        n = len(job.prompt_ids)
        ids = torch.tensor([job.prompt_ids], device=dev)  # [1, n]
        fed = embed(torch.tensor([job.prompt_ids + job.reply_ids[:-1]], device=dev))  # [1, n + g - 1, H]
        # 1. user turns: every position whose role (the token after its last <|im_start|>) is the user's
        positions = torch.arange(n, device=dev)[None]
        starts = torch.where(ids == config.im_start_token_id, positions, positions.new_full((), -1))
        roles = ids.gather(1, (torch.cummax(starts, dim=-1).values.clamp_min(0) + 1).clamp_max(n - 1))
        user = roles == config.user_token_id
        thinker = config.thinker_config
        media = torch.isin(ids, torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id],
                                             device=dev))
        user_rows = torch.empty((1, n, codec.text_config.hidden_size), device=dev, dtype=talker.dtype)
        if media.any():
            assert job.media_hidden is not None  # the stage computes them for a prompt with media
            user_rows[media] = talker.hidden_projection(job.media_hidden.to(dev))
        user_rows[~media] = talker.text_projection(fed[:, :n][~media])
        user_embeds, user_ids = user_rows[user][None], ids[user][None]
        # 2. the reply's start: its role tokens and first token, the speaker and the codec's control ids
        start = int(torch.nonzero((ids[0, :-1] == config.im_start_token_id) &
                                  (ids[0, 1:] == config.assistant_token_id)).flatten()[-1])
        special = torch.tensor([[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]],
                               device=dev)
        tts_bos, tts_eos, tts_pad = talker.text_projection(embed(special)).chunk(3, dim=1)  # 3 x [1, 1, H]
        reply = talker.text_projection(fed[:, start:])
        text_part = torch.cat((reply[:, :3], tts_pad.expand(1, 4, -1), tts_bos, reply[:, 3:4]), dim=1)
        controls = torch.tensor([[codec.codec_nothink_id, codec.codec_think_bos_id, codec.codec_think_eos_id,
                                  codec.speaker_id[job.speaker], codec.codec_pad_id, codec.codec_bos_id]], device=dev)
        codec_part = torch.cat((torch.zeros((1, 3, codec.text_config.hidden_size), device=dev, dtype=talker.dtype),
                                talker.get_input_embeddings()(controls)), dim=1)
        # 3. the rest of the reply, one token a step, then text-end. (generate() moves each row's text-end to just
        # after its own eos in a batch; a reply alone ends at its eos: there it changes nothing.)
        trailing = torch.cat((reply[:, 4:], tts_eos), dim=1)
        assistant_ids = torch.full((1, text_part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=dev)
        embeds = torch.cat((user_embeds, text_part + codec_part), dim=1)
        inputs: dict[str, Any] = dict(inputs_embeds=embeds, trailing_text_hidden=trailing, tts_pad_embed=tts_pad,
                                      talker_input_ids=torch.cat((user_ids, assistant_ids), dim=1),
                                      attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=dev))
        if job.audio_frames:
            inputs["audio_feature_lengths"] = torch.tensor(job.audio_frames, device=dev)
        if job.image_grids:
            inputs["image_grid_thw"] = torch.tensor(job.image_grids, device=dev)
        return inputs

    @torch.inference_mode()
    def codes(self, job: Talker3Job, max_codes: int) -> torch.Tensor:
        """One reply's codes [code groups, frames] (no frames for a reply of one token, or a talker that ends at
        once): transformers' talker `generate()` with `generate()`'s sampling (temperature 0.9, top-k 50, repetition
        penalty 1.05, the codec's control ids suppressed but its eos), drawing from the request's seed."""
        codec = self.config.talker_config
        groups = codec.num_code_groups
        if len(job.reply_ids) < 2:  # generate() needs a fed reply token for the reply's start
            return torch.zeros(groups, 0, dtype=torch.long)
        vocab = codec.text_config.vocab_size
        suppressed = [i for i in range(vocab - 1024, vocab) if i != codec.codec_eos_token_id]
        with seeded_stream(self.device, job.seed):  # its lock also keeps other requests off the talker's state
            result = self.talker.generate(**self.talker_inputs(job), max_new_tokens=max_codes, do_sample=True,
                                          top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                                          eos_token_id=codec.codec_eos_token_id, suppress_tokens=suppressed,
                                          output_hidden_states=True, return_dict_in_generate=True)
        frames = [step[-1] for step in result.hidden_states if step[-1] is not None]  # each fed code's groups
        if not frames:
            return torch.zeros(groups, 0, dtype=torch.long)
        return torch.cat(frames, dim=0).T.cpu()  # [groups, frames]

    @torch.inference_mode()
    def waveform(self, codes: torch.Tensor) -> torch.Tensor:
        """code2wav, as `generate()` decodes one reply (chunks of 300 frames, 25 of left context): float32 [samples]
        at 24 kHz."""
        if codes.shape[1] == 0:
            return torch.zeros(0)
        wav = self.code2wav.chunked_decode(codes[None].to(self.device), chunk_size=300, left_context_size=25)
        return wav.reshape(-1).float().cpu()


class _Speech3Stage(Stage):
    """A stage of one model's speech half: every item of the model batches with every other."""

    def __init__(self, model: str, voice: Omni3Voice):
        self.model = model
        self.voice = voice

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model


class Talker3Stage(_Speech3Stage):
    """The thinker's reply (its prompt, tokens, and the media's features and geometry) -> codes; the llm's choices
    and usage pass on."""

    kind = "talker"

    def __init__(self, model: str, voice: Omni3Voice, max_codes: int = 4096):
        super().__init__(model, voice)
        self.max_codes = max_codes  # generate()'s talker_max_new_tokens

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        outputs = []
        for item in items:
            request: GenerationRequest = item.inputs["request"]
            choice = item.inputs["choices"][0]
            choice.pop("hidden", None)  # the llm's last-layer states: this talker reads other ones
            hidden = None
            if request.media:
                features = in_span_order(request.media, item.inputs.get("features"), item.inputs.get("audio_features"))
                spans = attach_features(request.media, features, num_tokens=len(request.prompt_ids),
                                        hidden_size=self.voice.thinker.config.text_config.hidden_size)
                hidden = self.voice.media_hidden(request, spans)
            tasks = (*item.inputs.get("media", ()), *item.inputs.get("audio_media", ()))
            job = Talker3Job(list(request.prompt_ids), choice["token_ids"], hidden,
                             tuple(t.geometry.audio_frames for t in tasks if t.geometry.kind == "audio"),
                             tuple(t.geometry.grid_thw for t in tasks if t.geometry.kind == "image"),
                             item.inputs["speech"].voice, item.inputs["speech"].seed)
            outputs.append({"codes": self.voice.codes(job, self.max_codes), "choices": item.inputs["choices"],
                            "usage": item.inputs["usage"]})
        return outputs


class Code2WavStage(_Speech3Stage):
    """Codes -> a 24 kHz waveform, one reply a call."""

    kind = "code2wav"

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [{"choices": item.inputs["choices"], "usage": item.inputs["usage"],
                 "audio": self.voice.waveform(item.inputs["codes"]), "sample_rate": SAMPLE_RATE} for item in items]
