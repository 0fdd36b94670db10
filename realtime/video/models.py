"""Session settings against the served models: which model, its defaults, and the checks that need it.

`resolve` turns what the client chose into what will run (every default filled, so `session.created`
reports the effective values) and refuses, naming the field, what the model cannot take: a mode it
does not serve, a size off its size factor or over the pixel limit, a chunk length off its frame rule.
The checks are the engine's own request checks (family.validate), run once here instead of failing
every frame.
"""

from __future__ import annotations

from dataclasses import replace

from PIL import Image

from pipelines.image_request import ImageRequest, RequestError, Task
from pipelines.model_default import default_model
from pipelines.served import ModelInfo
from pipelines.served_diffusion import REALTIME_VIDEO_TASK
from pipelines.video import VideoRequest
from realtime.video.protocol import ProtocolError, VideoSettings, parse_size

MODE_TASK = {"img2img": "image-to-image", "t2v": "text-to-video"}  # the pipeline task a mode runs on
IMG2IMG_FPS = 30.0  # the camera rate assumed when the client names none
T2V_LOOKAHEAD = 2  # chunks in flight: the next chunk's denoise overlaps this one's decode and send
_PARAMS = {"size": "session.size", "num_frames": "session.chunk_frames", "num_inference_steps": "session.steps",
           "guidance_scale": "session.guidance_scale", "fps": "session.fps", "seed": "session.seed",
           "prompt": "session.prompt", "strength": "session.strength", "model": "session.model"}


def video_models(engine, mode: str) -> list[str]:
    """Served models that list the realtime-video task and run `mode`."""
    return [name for name, info in engine.models.items()
            if REALTIME_VIDEO_TASK in info.tasks and MODE_TASK[mode] in info.tasks]


def resolve(engine, settings: VideoSettings) -> VideoSettings:
    """The effective settings: model chosen, defaults filled, everything checked against the model."""
    served = video_models(engine, settings.mode)
    model = settings.model
    if model is None:  # the default rule (pipelines/model_default.py) among the models that serve this mode
        model = default_model({name: engine.models[name] for name in served}, MODE_TASK[settings.mode])
    if model not in served:
        raise ProtocolError("model_not_found", f"model {model!r} does not serve realtime video in mode "
                                               f"{settings.mode}; models that do: {served}", "session.model")
    if not settings.prompt or not settings.prompt.strip():
        raise ProtocolError("invalid_value", "prompt is required (a non-empty string)", "session.prompt")
    info: ModelInfo = engine.models[model]
    settings = replace(settings, model=model)
    return _img2img(engine, info, settings) if settings.mode == "img2img" else _t2v(engine, info, settings)


def size_of(settings: VideoSettings) -> tuple[int, int]:
    return parse_size(settings.size)


def denoise_steps(settings: VideoSettings) -> int:
    """Steps one img2img frame runs: the pipeline's int(num_inference_steps * strength)."""
    return min(settings.steps, int(settings.steps * settings.strength))


def min_steps(settings: VideoSettings) -> int:
    """The fewest img2img steps that still leave one denoising step at this strength (t2v: 1)."""
    if settings.mode != "img2img":
        return 1
    steps = 1
    while int(steps * settings.strength) < 1:
        steps += 1
    return steps


def _img2img(engine, info: ModelInfo, s: VideoSettings) -> VideoSettings:
    size = s.size or f"{info.default_size}x{info.default_size}"
    s = replace(s, size=size, fps=s.fps or IMG2IMG_FPS)
    width, height = parse_size(size)
    if denoise_steps(s) < 1:
        raise ProtocolError("invalid_value", f"steps {s.steps} at strength {s.strength} leave no denoising step; "
                                             f"use steps >= {min_steps(s)}", "session.steps")
    probe = ImageRequest(prompt=s.prompt, task=Task.IMAGE_TO_IMAGE, negative_prompt=s.negative_prompt, width=width,
                         height=height, num_inference_steps=s.steps, guidance_scale=s.guidance_scale, seed=s.seed,
                         strength=s.strength, image=Image.new("RGB", (1, 1)))
    _check(lambda: engine.family(s.model).validate(probe, engine.config.limits))
    return replace(s, lookahead=s.lookahead or denoise_steps(s))


def _t2v(engine, info: ModelInfo, s: VideoSettings) -> VideoSettings:
    video = info.video_defaults or {}
    factor = video.get("frame_factor", 1)
    size = s.size or f"{video.get('width', info.default_size)}x{video.get('height', info.default_size)}"
    continuation = s.continuation
    if continuation == "auto":
        continuation = "i2v" if "image-to-video" in info.tasks else "none"
    if continuation == "i2v" and "image-to-video" not in info.tasks:
        raise ProtocolError("invalid_value", f"model {s.model} does not do image-to-video, so chunks cannot "
                                             "continue from the last frame; use continuation 'none'",
                            "session.continuation")
    s = replace(s, size=size, fps=s.fps or video.get("fps", 16.0), chunk_frames=s.chunk_frames or 2 * factor + 1,
                continuation=continuation, lookahead=s.lookahead or T2V_LOOKAHEAD)
    if continuation == "i2v" and s.chunk_frames < 2:
        raise ProtocolError("invalid_value", "continuing chunks repeat the previous last frame, so chunk_frames "
                                             "must be >= 2", "session.chunk_frames")
    width, height = parse_size(size)
    probe = VideoRequest(prompt=s.prompt, negative_prompt=s.negative_prompt, width=width, height=height,
                         num_frames=s.chunk_frames, fps=s.fps, num_inference_steps=s.steps,
                         guidance_scale=s.guidance_scale, seed=s.seed)
    _check(lambda: engine.family(s.model).validate(probe))
    return s


def _check(validate) -> None:
    try:
        validate()
    except RequestError as e:
        raise ProtocolError(e.code, e.message, _PARAMS.get(e.param or "", e.param)) from None
