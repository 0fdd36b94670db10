"""OpenAI chat content parts for vision-language models: checked and split into text and media.

Accepted parts: `text`, `image_url` ({"url", "detail"}), the `video_url` extension ({"url", "fps",
"max_frames"}), OpenAI's `input_audio` ({"data": base64, "format": "wav" | "mp3"}) and the `audio_url`
extension ({"url"}), each only where the model takes that kind (a model's `accepts`). Every refusal
names the field (`messages[i].content[j]...`) and the limit. These checks cost nothing: they run
before any fetch, decode or model work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipelines.image_request import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
DETAILS = ("auto", "low", "high")
AUDIO_FORMATS = ("wav", "mp3")  # input_audio.format, as OpenAI's chat API takes it
KINDS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}


@dataclass(frozen=True)
class VLMConfig:
    """Per-request media limits and the vision encoder's knobs (checked before any fetch)."""

    max_images: int = 8  # image parts in one request (all messages)
    max_videos: int = 2  # video parts in one request
    max_video_frames: int = 32  # frames sampled from one video (the request's max_frames may only lower it)
    default_video_fps: float = 2.0  # frames per second sampled when a video part names no fps
    low_detail_max_pixels: int = 256 * 28 * 28  # detail="low": image pixel budget (dynamic-resolution models)
    max_items_per_forward: int = 32  # media items in one encoder forward
    max_audios: int = 4  # audio parts in one request
    max_audio_s: float = 30.0  # one audio part's length (an audio-language model's encoder window may lower it)
    # A streamed spoken reply (an omni model's talker): token2wav decodes a first chunk of this many DiT blocks (12
    # codes, 0.24 s each for Qwen2.5-Omni), each later chunk twice the one before up to the max, each with this many
    # blocks of context on either side. Fewer context blocks: earlier audio, further from the whole reply's
    # (docs/omni.md has the measured error of each).
    speech_chunk_blocks: int = 1
    speech_max_chunk_blocks: int = 8
    speech_context_blocks: int = 3
    max_speech_codes: int = 4096  # a spoken reply's talker stops after this many codes (generate()'s default too)

    def __post_init__(self):
        if min(self.max_images, self.max_videos, self.max_audios) < 0 or self.max_video_frames < 1:
            raise ValueError("vlm.max_images, vlm.max_videos and vlm.max_audios must be >= 0, "
                             "vlm.max_video_frames >= 1")
        if not (math.isfinite(self.max_audio_s) and self.max_audio_s > 0):
            raise ValueError(f"vlm.max_audio_s must be > 0, got {self.max_audio_s}")
        if not (math.isfinite(self.default_video_fps) and self.default_video_fps > 0):
            raise ValueError(f"vlm.default_video_fps must be > 0, got {self.default_video_fps}")
        if self.low_detail_max_pixels < 1 or self.max_items_per_forward < 1:
            raise ValueError("vlm.low_detail_max_pixels and vlm.max_items_per_forward must be >= 1")
        if min(self.speech_chunk_blocks, self.speech_max_chunk_blocks, self.max_speech_codes) < 1 \
                or self.speech_context_blocks < 0:
            raise ValueError("vlm.speech_chunk_blocks, vlm.speech_max_chunk_blocks and vlm.max_speech_codes must be "
                             ">= 1, vlm.speech_context_blocks >= 0")


@dataclass(frozen=True)
class MediaPart:
    """One image, video or audio clip a request names, before it is fetched."""

    kind: str  # "image", "video" or "audio"
    url: str  # data: URI, http(s):// URL or an allowed file:// URL (input_audio: a data: URI of its base64)
    param: str  # the field that named it, for errors: "messages[0].content[1].image_url.url"
    detail: str = "auto"  # images: resolution hint
    fps: float | None = None  # videos: frames per second to sample
    max_frames: int | None = None  # videos: at most this many frames
    audio_format: str | None = None  # input_audio: the format the request declares ("wav" or "mp3")


@dataclass(frozen=True)
class ParsedChat:
    """Messages with their content split into text and media, in order."""

    # Each message: {"role", "content": str | [{"type": "text", "text"} | {"type": "media", "index": i}]}
    messages: list[dict[str, Any]]
    media: list[MediaPart]  # in order of appearance; "index" above points here


def checked_message(message: Any, i: int) -> tuple[str, str, Any]:
    """messages[i] -> (where, role, content) with the role checked; an assistant's null content is ""."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(where, f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{where}.role must be one of {list(ROLES)}; got {role!r}")
    content = message.get("content")
    return where, role, "" if content is None and role == "assistant" else content


def parse_messages(messages: Any, config: VLMConfig, accepts: tuple[str, ...] = ("image", "video"),
                   model: str = "this model") -> ParsedChat:
    """Messages checked and split; `accepts`: the media kinds the model reads (a part of another kind is refused
    naming it)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must hold at least one message")
    out: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for i, message in enumerate(messages):
        where, role, content = checked_message(message, i)
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{j}]", role, media, accepts, model)
                       for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of content parts")
        out.append({"role": role, "content": content})
    _check_counts(media, config)
    return ParsedChat(out, media)


def _part(part: Any, where: str, role: str, media: list[MediaPart], accepts: tuple[str, ...],
          model: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text", f"{where}.text must be a string")
        return {"type": "text", "text": part["text"]}
    if kind not in KINDS:
        raise RequestError(f"{where}.type", f"{where}.type must be one of ['text', {', '.join(map(repr, KINDS))}]; "
                           f"got {kind!r}", code="unsupported_content")
    if KINDS[kind] not in accepts:
        raise RequestError(f"{where}.type", f"{where}: model {model} takes no {KINDS[kind]} input (it reads text"
                           f"{''.join(', ' + k for k in accepts)})", code="unsupported_content")
    if role != "user":
        raise RequestError(f"{where}.type", f"{where}: {kind} parts are only accepted in user messages; "
                           f"this is a {role} message", code="unsupported_content")
    if kind == "input_audio":
        return _input_audio(part.get("input_audio"), where, media)
    body = part.get(kind)
    if not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"]:
        raise RequestError(f"{where}.{kind}.url", f"{where}.{kind} must be an object with a non-empty url")
    known = {"image_url": ("url", "detail"), "video_url": ("url", "fps", "max_frames"), "audio_url": ("url",)}[kind]
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RequestError(f"{where}.{kind}", f"{where}.{kind} has unknown field(s) {unknown}; allowed: {list(known)}")
    if kind == "image_url":
        detail = body.get("detail", "auto") or "auto"
        if detail not in DETAILS:
            raise RequestError(f"{where}.image_url.detail", f"{where}.image_url.detail must be one of "
                               f"{list(DETAILS)}; got {detail!r}")
        media.append(MediaPart("image", body["url"], f"{where}.image_url.url", detail=detail))
    elif kind == "audio_url":
        media.append(MediaPart("audio", body["url"], f"{where}.audio_url.url"))
    else:
        fps, max_frames = body.get("fps"), body.get("max_frames")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps)
                                or fps <= 0):
            raise RequestError(f"{where}.video_url.fps", f"{where}.video_url.fps must be a number > 0; got {fps!r}")
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                       or max_frames < 1):
            raise RequestError(f"{where}.video_url.max_frames", f"{where}.video_url.max_frames must be an integer "
                               f">= 1; got {max_frames!r}")
        media.append(MediaPart("video", body["url"], f"{where}.video_url.url", fps=fps, max_frames=max_frames))
    return {"type": "media", "index": len(media) - 1}


def _input_audio(body: Any, where: str, media: list[MediaPart]) -> dict[str, Any]:
    """OpenAI's {"data": base64, "format": "wav" | "mp3"}: the data becomes a data: URI (fetched like any)."""
    if not isinstance(body, dict):
        raise RequestError(f"{where}.input_audio", f"{where}.input_audio must be an object with data and format")
    unknown = sorted(set(body) - {"data", "format"})
    if unknown:
        raise RequestError(f"{where}.input_audio", f"{where}.input_audio has unknown field(s) {unknown}; allowed: "
                           "['data', 'format']")
    fmt = body.get("format")
    if fmt not in AUDIO_FORMATS:
        raise RequestError(f"{where}.input_audio.format", f"{where}.input_audio.format must be one of "
                           f"{list(AUDIO_FORMATS)}; got {fmt!r}", code="unsupported_format")
    data = body.get("data")
    if not isinstance(data, str) or not data:
        raise RequestError(f"{where}.input_audio.data", f"{where}.input_audio.data must be a non-empty base64 string")
    media.append(MediaPart("audio", f"data:audio/{fmt};base64,{data}", f"{where}.input_audio.data",
                           audio_format=fmt))
    return {"type": "media", "index": len(media) - 1}


def _check_counts(media: list[MediaPart], config: VLMConfig) -> None:
    images = [m for m in media if m.kind == "image"]
    videos = [m for m in media if m.kind == "video"]
    if len(images) > config.max_images:
        raise RequestError(images[config.max_images].param.rsplit(".url", 1)[0],
                           f"the request has {len(images)} images; the limit is {config.max_images} (max_images)",
                           code="too_many_images")
    if len(videos) > config.max_videos:
        raise RequestError(videos[config.max_videos].param.rsplit(".url", 1)[0],
                           f"the request has {len(videos)} videos; the limit is {config.max_videos} (max_videos)",
                           code="too_many_videos")
    audios = [m for m in media if m.kind == "audio"]
    if len(audios) > config.max_audios:
        raise RequestError(audios[config.max_audios].param.rsplit(".", 1)[0],
                           f"the request has {len(audios)} audio clips; the limit is {config.max_audios} (max_audios)",
                           code="too_many_audios")
    for video in videos:
        if video.max_frames is not None and video.max_frames > config.max_video_frames:
            raise RequestError(video.param.replace(".url", ".max_frames"),
                               f"max_frames is {video.max_frames}; the limit is {config.max_video_frames} "
                               "(max_video_frames)", code="too_many_frames")


def has_media_parts(messages: Any) -> bool:
    """Whether any message has a non-text content part (cheap, before parsing)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not (isinstance(p, dict) and p.get("type") == "text") for p in m["content"]) for m in messages)
