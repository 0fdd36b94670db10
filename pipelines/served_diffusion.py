"""Diffusion models as served models (pipelines/served.py's contract): a native family's stage graph
(text_encode -> denoise -> vae_decode [-> media_encode], ServedDiffusion) behind ServedImages, the kind the
diffusers fallback (pipelines/fallback.py) shares."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from encoders.cache import EncoderCache
from pipelines.config import CPU_VIDEO_POOLS, ModelSpec
from pipelines.families.base import ImageFamily
from pipelines.families.video_base import VideoFamily
from pipelines.image_request import ImageRequest, ModelNotFound, RequestError, Task
from pipelines.offload import apply_offload
from pipelines.quantize import quantized_methods
from pipelines.registry import family_class
from pipelines.served import Execution, LoadContext, ModelInfo, chain, lora_limits
from pipelines.video import VideoRequest
from stages.cuda_graphs import GraphConfig
from stages.diffusion.stages import DenoiseStage, TextEncodeStage, VaeDecodeStage
from stages.graph import Node, StageGraph
from stages.media.stage import MediaDecodeStage, MediaEncodeStage, decode_images

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pipelines.engine import Engine

REALTIME_VIDEO_TASK = "realtime-video"  # ModelInfo.tasks of a model that serves WS /v1/realtime/video sessions


def load_family(spec: ModelSpec, family_name: str, prompt_cache: EncoderCache) -> ImageFamily | VideoFamily:
    """The diffusion family of `spec` loaded on spec.device (a served model's, or a parallel replica's rank's)."""
    cls = family_class(family_name)
    options = {"video": spec.video} if issubclass(cls, VideoFamily) else {}
    return cls(spec.name, spec.path, device=spec.device, dtype=spec.dtype, prompt_cache=prompt_cache,
               quantize=spec.quantize, **options)


class ServedImages:
    """A model that makes images from an ImageRequest: a native family's stage graph (ServedDiffusion) or a diffusers
    pipeline run through its own __call__ (pipelines/fallback.py's ServedPipeline)."""

    does, kinds = "generate images", "image models"
    name: str
    info: ModelInfo

    def check_fields(self, request: ImageRequest) -> None:
        """The request's own fields, before an input image is fetched or decoded; RequestErrors name the field."""
        raise NotImplementedError


class ServedDiffusion(ServedImages):
    """An image or video diffusion family: text_encode -> denoise (the loop) -> vae_decode, then media_encode
    when the request asks for encoded files (the server's do; the Python API's keep pixels)."""

    does, kinds = "generate images or videos", "diffusion models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        if spec.preview_vae and not getattr(family_class(family_name), "takes_preview_vae", False):
            raise ValueError(f"model {spec.name}: preview_vae is not supported by family {family_name} (it is for "
                             "the image families sd, sdxl, sd3 and flux, and those built on them)")
        family = load_family(spec, family_name, ctx.prompt_cache)
        if spec.preview_vae:  # previews decode with a tiny VAE; the parallel ranks never preview, so load it here
            assert isinstance(family, ImageFamily)  # (takes_preview_vae)
            family.load_preview_vae(spec.preview_vae)
        if spec.max_lora_rank is not None:
            raise ValueError(f"model {spec.name}: max_lora_rank is for language models (their decode graphs)")
        if (spec.loras or spec.lora_dirs) and isinstance(family, VideoFamily):
            raise ValueError(f"model {spec.name}: loras are for image and language models (video requests name no "
                             "adapter yet)")
        family.load_loras(spec.loras, **lora_limits(spec))  # before the speed-ups wrap the modules
        speedups = spec.speedups
        if spec.offload:
            apply_offload(spec.name, family.pipe.components, spec.offload, family.device)
            if spec.graphs.enabled:
                log.warning("model %s: CUDA graphs off: offloaded weights move between forwards, which a captured "
                            "graph cannot follow", spec.name)
                speedups = dataclasses.replace(speedups, graphs=GraphConfig())
        family.accelerate(speedups, ctx.metrics)  # fused kernels, compile, step-cache wrappers, graph config
        family.set_memory_budget(None if spec.memory_budget_mb is None else int(spec.memory_budget_mb * 2**20))
        family.parallel = spec.parallel
        if spec.parallel.vae:  # the tiled decode's tiles over the ranks: tiling on (video.vae_tile's size)
            from pipelines.parallel_vae import check_parallel_vae

            check_parallel_vae(family)
            assert isinstance(family, VideoFamily)  # (a Wan VAE is a video family's)
            family.enable_vae_tiling()
        if spec.parallel.world > 1 and ctx.runs:  # the denoise replica's other ranks: processes with the family
            from pipelines.parallel import start_ranks

            family.ranks = start_ranks(spec, family_name, family, ctx.metrics)
        self.name, self.model, self.graphs, self.limits = spec.name, family, speedups.graphs, ctx.limits
        self.device = spec.device
        self.media, self.media_pool, self.decode_limits = ctx.media, ctx.media_pool, ctx.media_config.image
        tasks = _realtime_video(family_name, family.tasks)
        memory: dict[str, Any] = {"quantization": quantized_methods(family.quantization) or None,
                                  "resident_bytes": family.resident_bytes}
        if isinstance(family, VideoFamily):
            (width, height), video = family.request_default_size, family.video_defaults
            self.info = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor, max(width, height),
                                  video_defaults=video, random_weights=random_weights, **memory)
        else:
            self.info = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor, family.default_size,
                                  random_weights=random_weights, adapters=family.loras.names(), **memory)

    def close(self) -> None:
        """Stop what runs outside the serving process (a parallel replica's ranks)."""
        self.model.close()

    def stages(self):
        video = isinstance(self.model, VideoFamily)
        vae_pool = CPU_VIDEO_POOLS["vae_decode"] if video and self.device == "cpu" else None
        stages = (("text_encode", TextEncodeStage(self.model), None), ("denoise", DenoiseStage(self.model), None),
                  ("vae_decode", VaeDecodeStage(self.model), vae_pool))
        if video:  # videos are encoded by their job (serve/job_runner.py)
            return stages
        media = self.media_pool
        decode = MediaDecodeStage(self.name, self.media, decode_images(self.decode_limits), self.finalize)
        return (("media_decode", decode, media), *stages, ("media_encode", MediaEncodeStage(self.name, self.media),
                                                           media))

    def execution(self, request: ImageRequest | VideoRequest) -> Execution:
        if isinstance(request, VideoRequest):
            return Execution(chain(self.name, "text_encode", "denoise", "vae_decode"), {"request": self.check(request)})
        inputs: dict[str, Any] = {}
        if request.source is not None:  # an upload to decode first: check what needs no image now
            self.check_fields(request)
            inputs["request"], inputs["decode"] = request, request.source
        else:
            inputs["request"] = self.check(request)
        if request.output is not None:
            inputs["encode"] = request.output
        return Execution(self.image_graph(decode=request.source is not None, encode=request.output is not None),
                         inputs)

    def image_graph(self, *, decode: bool, encode: bool) -> StageGraph:
        """[media_decode ->] text_encode -> denoise -> vae_decode [-> media_encode]. After media_decode every
        model node also reads it (the request it finalized, with its images and drawn seed); a node reads its
        inputs from the nodes it names, the later one winning."""
        first: tuple[str, ...] = ("media_decode",) if decode else ()
        nodes = [Node(kind, f"{self.name}/{kind}", after) for kind, after in (
            ("text_encode", first), ("denoise", (*first, "text_encode")), ("vae_decode", (*first, "denoise")))]
        if decode:
            nodes.insert(0, Node("media_decode", f"{self.name}/media_decode"))
        if encode:
            nodes.append(Node("media_encode", f"{self.name}/media_encode", ("vae_decode",)))
        return StageGraph(tuple(nodes), nodes[-1].name)

    def check_fields(self, request: ImageRequest) -> None:
        """An edit's own fields against the model and limits, before its upload is decoded (what depends on the
        image, and the family's default steps and guidance, is checked in `finalize`)."""
        if request.task.value not in self.info.tasks:
            raise RequestError("model", f"model {self.name} does not support {request.task.value}; it supports "
                                        f"{list(self.info.tasks)}")
        assert isinstance(self.model, ImageFamily)  # (a video model does no image task)
        request.check_fields(size_factor=self.info.size_factor, default_size=self.info.default_size,
                             limits=self.limits, several_images=self.model.several_images)

    def finalize(self, request: ImageRequest, decoded) -> dict[str, Any]:
        """The edit with its decoded image and mask, checked (media_decode calls it): with size auto it gets the
        family's edit size (the image's, rounded down to the model's multiple, unless the family resizes it)."""
        image, mask = decoded
        factor = self.info.size_factor
        width, height = request.width, request.height
        assert isinstance(self.model, ImageFamily)  # media_decode runs on image graphs only (stages)
        if isinstance(image, list) and len(image) == 1 and not self.model.several_images:
            image = image[0]  # a list of one, for a model that edits one image
        last = image[-1] if isinstance(image, list) else image  # several images: the output follows the last
        if width is None and height is None:
            size = self.model.edit_size(last)
            if size is not None:
                width, height = size
                if width < factor or height < factor:
                    raise RequestError("image", f"image is {last.size[0]}x{last.size[1]}; this model needs at "
                                                f"least {factor}x{factor}", code="image_too_small")
        edit = dataclasses.replace(request, image=image, mask=mask, width=width, height=height, source=None)
        edit = self.model.validate(edit, self.limits)
        self.model.check_memory(edit)
        return {"request": edit}

    def check(self, request: ImageRequest | VideoRequest) -> ImageRequest | VideoRequest:
        """The request as it will run (defaults filled, a seed drawn), or the field-naming RequestError."""
        if isinstance(request, VideoRequest):
            if not isinstance(self.model, VideoFamily):  # (routes refuse it sooner: unsupported_task)
                raise ModelNotFound(f"model {self.name!r} does not make videos; it does "
                                    f"{list(self.info.tasks)}")
            video = self.model.validate(request)
            self.model.check_memory(video)
            return video
        if isinstance(self.model, VideoFamily):
            raise RequestError("model", f"model {self.name} makes videos ({list(self.model.tasks)}); use /v1/videos")
        image = self.model.validate(request, self.limits)
        self.model.check_memory(image)
        return image

    def warm(self, engine: Engine) -> None:
        """A tiny request, or one per declared graph shape (each captures its buckets); then seal."""
        info, graphs = self.info, self.graphs
        if isinstance(self.model, VideoFamily):  # a small video: one latent frame past the first
            from PIL import Image

            assert info.video_defaults is not None  # a video family's info always has them
            size, frames = info.size_factor, info.video_defaults["frame_factor"] + 1
            image = None if "text-to-video" in info.tasks else Image.new("RGB", (size, size), (128, 128, 128))
            for (width, height), num_frames in [(s, f) for s in graphs.sizes or [(size, size)]
                                                for f in graphs.frames or [frames]]:
                engine.submit(self.name, VideoRequest(prompt="warm-up", width=width, height=height,
                                                      num_frames=num_frames, num_inference_steps=2, seed=0,
                                                      image=image)).result(timeout=600)
        else:  # a parallel replica's ranks may run one row each: too few pixels for a small UNet's group norms
            size = info.size_factor * 2 if self.model.parallel.world == 1 else info.default_size
            for width, height in graphs.sizes or [(size, size)]:
                engine.submit(self.name, self.model.warm_request(width, height)).result(timeout=600)
        self.model.denoiser.seal()

    def describe(self) -> str:
        return ", ".join(self.info.tasks)


def image_task(has_image: bool, has_mask: bool) -> Task:
    if has_mask:
        return Task.INPAINTING
    return Task.IMAGE_TO_IMAGE if has_image else Task.TEXT_TO_IMAGE


def _realtime_video(family: str, tasks: tuple[str, ...]) -> tuple[str, ...]:
    """A model's tasks plus realtime-video when it can serve video sessions: SD-family image-to-image
    (StreamDiffusion-style img2img) and text-to-video families (chunked t2v)."""
    img2img = family in ("sd", "sdxl") and Task.IMAGE_TO_IMAGE.value in tasks
    return (*tasks, REALTIME_VIDEO_TASK) if img2img or "text-to-video" in tasks else tasks
