"""OpenAI chat content parts for vision-language models: checked and split into text and media.

Accepted parts: `text`, `image_url` ({"url", "detail"}), and the `video_url` extension
({"url", "fps", "max_frames"}). `input_audio` is refused with a clear 400 until a speech model
can transcribe it. Every refusal names the field (`messages[i].content[j]...`) and the limit.
These checks cost nothing: they run before any fetch, decode or model work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipelines.image_request import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
DETAILS = ("auto", "low", "high")
AUDIO_REFUSAL = "audio input needs a speech model; not available yet"


@dataclass(frozen=True)
class VLMConfig:
    """Per-request media limits and the vision encoder's knobs (checked before any fetch)."""

    max_images: int = 8  # image parts in one request (all messages)
    max_videos: int = 2  # video parts in one request
    max_video_frames: int = 32  # frames sampled from one video (the request's max_frames may only lower it)
    default_video_fps: float = 2.0  # frames per second sampled when a video part names no fps
    low_detail_max_pixels: int = 256 * 28 * 28  # detail="low": image pixel budget (dynamic-resolution models)
    max_items_per_forward: int = 32  # media items in one encoder forward

    def __post_init__(self):
        if min(self.max_images, self.max_videos) < 0 or self.max_video_frames < 1:
            raise ValueError("vlm.max_images and vlm.max_videos must be >= 0, vlm.max_video_frames >= 1")
        if not (math.isfinite(self.default_video_fps) and self.default_video_fps > 0):
            raise ValueError(f"vlm.default_video_fps must be > 0, got {self.default_video_fps}")
        if self.low_detail_max_pixels < 1 or self.max_items_per_forward < 1:
            raise ValueError("vlm.low_detail_max_pixels and vlm.max_items_per_forward must be >= 1")


@dataclass(frozen=True)
class MediaPart:
    """One image or video a request names, before it is fetched."""

    kind: str  # "image" or "video"
    url: str  # data: URI, http(s):// URL or an allowed file:// URL
    param: str  # the field that named it, for errors: "messages[0].content[1].image_url.url"
    detail: str = "auto"  # images: resolution hint
    fps: float | None = None  # videos: frames per second to sample
    max_frames: int | None = None  # videos: at most this many frames


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


def parse_messages(messages: Any, config: VLMConfig) -> ParsedChat:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must hold at least one message")
    out: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for i, message in enumerate(messages):
        where, role, content = checked_message(message, i)
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{j}]", role, media) for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of content parts")
        out.append({"role": role, "content": content})
    _check_counts(media, config)
    return ParsedChat(out, media)


def _part(part: Any, where: str, role: str, media: list[MediaPart]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text", f"{where}.text must be a string")
        return {"type": "text", "text": part["text"]}
    if kind == "input_audio":
        raise RequestError(f"{where}.type", f"{where}: {AUDIO_REFUSAL}", code="unsupported_content")
    if kind not in ("image_url", "video_url"):
        raise RequestError(f"{where}.type", f"{where}.type must be one of ['text', 'image_url', 'video_url']; "
                           f"got {kind!r}", code="unsupported_content")
    if role != "user":
        raise RequestError(f"{where}.type", f"{where}: {kind} parts are only accepted in user messages; "
                           f"this is a {role} message", code="unsupported_content")
    body = part.get(kind)
    if not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"]:
        raise RequestError(f"{where}.{kind}.url", f"{where}.{kind} must be an object with a non-empty url")
    known = {"image_url": ("url", "detail"), "video_url": ("url", "fps", "max_frames")}[kind]
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RequestError(f"{where}.{kind}", f"{where}.{kind} has unknown field(s) {unknown}; allowed: {list(known)}")
    if kind == "image_url":
        detail = body.get("detail", "auto") or "auto"
        if detail not in DETAILS:
            raise RequestError(f"{where}.image_url.detail", f"{where}.image_url.detail must be one of "
                               f"{list(DETAILS)}; got {detail!r}")
        media.append(MediaPart("image", body["url"], f"{where}.image_url.url", detail=detail))
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
