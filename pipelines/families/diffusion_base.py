"""What the image and the video families share: loading, per-request pipeline views, prompt caching, speed-ups.

`DiffusionFamily` is the common base of `ImageFamily` (pipelines/families/base.py: ImageRequests, PIL images)
and `VideoFamily` (pipelines/families/video_base.py: VideoRequests, frames); the two are siblings, each with
its own request checks (`validate`) and decode. Both run the same three stages (text_encode -> denoise ->
vae_decode) through the hooks declared here: a family satisfies stages.diffusion.stages.DiffusionAdapter.

The diffusers pipeline object is used for its components and its helper methods (prompt encoding, latent
preparation) on a per-request *view* that carries the request's own scheduler; the denoise loop itself is ours
(stages/diffusion/stages.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import threading
import warnings
from typing import Any, Generic, Hashable, Iterable, TypeVar

import torch

from encoders.cache import EncoderCache, counting_lookups
from pipelines.adapters import Adapters
from pipelines.config import LoraSpec
from pipelines.families.speedups import DenoiserSpeedups
from pipelines.image_request import ImageRequest, RequestError, Task
from pipelines.quantize import Quantization, module_bytes
from pipelines.video import VideoRequest, VideoTask
from stages.diffusion.denoiser import DenoiserCall, Speedups
from stages.diffusion.memory import ActivationMemory, Size
from stages.events import ErrorKind
from stages.stage import WorkItem

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

TaskT = TypeVar("TaskT", bound=Task | VideoTask)  # the tasks a family's pipelines serve
RequestT = TypeVar("RequestT", bound=ImageRequest | VideoRequest)  # the checked request its stages read


class DiffusionFamily(DenoiserSpeedups, Generic[TaskT, RequestT]):
    """A diffusers checkpoint served on the diffusion stages: its pipeline per task (one set of modules), device
    and dtype, the prompt cache, per-request schedulers, views and generators, and the denoiser's speed-ups."""

    family: str = ""  # short name used in config and detection ("sd", "sdxl", "wan", ...)
    class_names: tuple[str, ...] = ()  # model_index.json `_class_name`s this family loads
    default_steps: int = 50
    default_guidance: float = 7.5
    load_kwargs: dict[str, Any] = {}  # extra from_pretrained arguments
    # The family-specific knobs a request may set (ImageRequest.extra keys; VideoRequest.true_cfg_scale): the
    # family reads these and refuses any other by name (`refuse_knobs`), so a knob never looks taken when it is not.
    request_knobs: frozenset[str] = frozenset()

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 prompt_cache: EncoderCache | None = None, quantize: dict[str, str] | None = None):
        self.name = name
        self.path = path
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.prompt_cache = prompt_cache if prompt_cache is not None else EncoderCache(f"{name}/prompt", 0)
        self.quantization = Quantization(dict(quantize)) if quantize else None  # pipelines/quantize.py
        first_task, base_cls = self.base_pipeline()
        quantized = self.quantization.load_kwargs(path, self.dtype) if self.quantization else {}
        base = base_cls.from_pretrained(path, dtype=self.dtype, **quantized, **self.load_kwargs)
        base.set_progress_bar_config(disable=True)
        base.to(self.device)
        # The variants share the same module objects (no extra weights in memory) and the base's own settings.
        self.pipes: dict[Task | VideoTask, Any] = {first_task: base}
        for task, cls in self.variants(base).items():
            params = inspect.signature(cls.__init__).parameters
            config = {k: v for k, v in base.config.items()
                      if k in params and k not in base.components and not k.startswith("_")}
            self.pipes[task] = cls(**base.components, **config)
            self.pipes[task].set_progress_bar_config(disable=True)
        # enters cache identities (quantized weights make other embeddings); a reload gets a new object anyway
        self.weights_id = f"{self.family}:{path}" + (f":{sorted(quantize.items())}" if quantize else "")
        self.loras = Adapters(name, self.load_adapter, self.unload_adapter)  # LoRAs a request may name
        self._vae_lock = threading.Lock()  # the VAE is shared by prepare (encode), previews and decode
        self.speedups = Speedups()
        self.denoiser = DenoiserCall(name)  # every speed-up off until `accelerate`
        self.memory_budget: int | None = None  # bytes for weights and one forward's activations (set_memory_budget)
        self.activations = ActivationMemory()
        self.weights_bytes = 0

    # -- loading ------------------------------------------------------------------------------
    # (type[Any]: mypy sees diffusers' lazy exports as dummies)
    def base_pipeline(self) -> tuple[TaskT, type[Any]]:
        """The task and diffusers pipeline class the checkpoint is loaded as (the first of `pipes`)."""
        raise NotImplementedError

    def variants(self, base) -> dict[TaskT, type[Any]]:
        """The other tasks' pipeline classes, built on the loaded base's modules."""
        raise NotImplementedError

    def load_adapter(self, spec: LoraSpec) -> int:
        """Load one adapter with diffusers' `load_lora_weights` (every format it reads) into the pipeline's modules,
        then have their LoRA layers apply adapters per row (stages/lora.py): the base weights stay as they are, and
        a request without adapters runs the base model. A file that is not a LoRA of this model fails here, naming
        it. Returns the adapter's bytes. (The Adapters registry calls it, holding the gate alone.)"""
        from stages.lora import adapter_bytes, mix_lora_layers

        try:
            with warnings.catch_warnings():  # PEFT warns of a second adapter in a model: that is the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                self.pipe.load_lora_weights(spec.path, adapter_name=spec.name)
        except Exception as exc:  # diffusers and PEFT raise many kinds (shape mismatch, missing keys, bad file)
            self._forget_adapter(spec.name)  # what a partial load injected
            raise ValueError(f"model {self.name}: lora {spec.name} ({spec.path}) does not load: "
                             f"{type(exc).__name__}: {exc}") from exc
        modules = self.adapted_modules()
        if not sum(mix_lora_layers(module) for module in modules):
            self._forget_adapter(spec.name)
            raise ValueError(f"model {self.name}: lora {spec.name} ({spec.path}) targets no linear layer")
        return sum(adapter_bytes(module, spec.name) for module in modules)

    def unload_adapter(self, name: str) -> None:
        from stages.lora import mix_lora_layers

        self.pipe.delete_adapters(name)
        for module in self.adapted_modules():  # PEFT activates a remaining adapter: off again
            mix_lora_layers(module)

    def _forget_adapter(self, name: str) -> None:
        try:
            self.unload_adapter(name)
        except Exception:  # nothing of it was injected
            log.debug("model %s: nothing of lora %s to take out", self.name, name, exc_info=True)

    def adapted_modules(self) -> list[torch.nn.Module]:
        """The pipeline's modules (a LoRA may adapt any of them)."""
        return [m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pipeline's weights as loaded (quantized ones at their stored size)."""
        return sum(module_bytes(m) for m in self.adapted_modules())

    def load_loras(self, loras: tuple[LoraSpec, ...], *, budget_bytes: int | None = None, dirs=()) -> None:
        """The model's declared adapters, its budget of resident adapter bytes and its run-time lora_dirs."""
        self.loras.budget_bytes, self.loras.dirs = budget_bytes, tuple(dirs)
        for spec in loras:
            self.loras.add(spec)

    # -- memory (stages/diffusion/memory.py) ------------------------------------------------
    def set_memory_budget(self, budget_bytes: int | None) -> None:
        self.memory_budget = budget_bytes
        self.weights_bytes = self.resident_bytes
        if budget_bytes is not None and self.weights_bytes >= budget_bytes:
            raise ValueError(f"model {self.name}: its weights take {self.weights_bytes / 2**20:.1f} MiB, more than its "
                             f"memory_budget_mb ({budget_bytes / 2**20:.1f} MiB)")

    def request_size(self, request: RequestT) -> Size:
        """(width, height, frames) of a request, as memory estimates key activations."""
        return (request.width or 0, request.height or 0, getattr(request, "num_frames", None) or 1)

    def request_rows(self, request: RequestT) -> int:
        """Rows of the denoiser batch one request takes: its images, twice with classifier-free guidance."""
        assert request.guidance_scale is not None  # validate() filled it
        cfg = self.uses_negative(request) or request.guidance_scale > 1.0
        return getattr(request, "n", 1) * (2 if cfg else 1)

    def memory_needed(self, size: Size, rows: int, *, upper: bool = True) -> int | None:
        estimate = self.activations.estimate(size, rows, upper=upper)
        return None if estimate is None else self.weights_bytes + estimate

    def check_memory(self, request: RequestT) -> None:
        """A request whose forward alone would pass the memory budget: a 413 before any model work."""
        if self.memory_budget is None:
            return
        need = self.memory_needed(self.request_size(request), self.request_rows(request), upper=False)
        if need is not None and need > self.memory_budget:
            width, height, frames = self.request_size(request)
            what = f"{width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
            raise RequestError("n" if getattr(request, "n", 1) > 1 else "size",
                               f"a {what} request of {self.request_rows(request)} denoiser rows needs about "
                               f"{need / 2**20:.1f} MiB (weights and activations), over model {self.name}'s "
                               f"memory_budget_mb of {self.memory_budget / 2**20:.1f} MiB; ask for fewer or smaller "
                               "images", code="memory_limit", kind=ErrorKind.TOO_LARGE)

    def fit(self, items: list[WorkItem]) -> int:
        """The leading items whose rows fit the budget in one forward (at least one)."""
        if self.memory_budget is None or not items:
            return len(items)
        size = self.request_size(items[0].inputs["request"])
        rows = 0
        for count, item in enumerate(items):
            rows += self.request_rows(item.inputs["request"])
            need = self.memory_needed(size, rows)
            if need is not None and need > self.memory_budget:
                return max(1, count)
        return len(items)

    def measured(self, items: list[WorkItem], rows: int):
        if self.memory_budget is None:
            return contextlib.nullcontext()
        size = self.request_size(items[0].inputs["request"])
        if self.activations.measured(size, rows):
            return contextlib.nullcontext()
        return self.activations.measure(size, rows, self.device)

    # -- request knobs ------------------------------------------------------------------------
    def knobs(self) -> frozenset[str]:
        """The knobs this model's requests may set (a family whose checkpoints differ may say per checkpoint)."""
        return self.request_knobs

    def refuse_knobs(self, given: Iterable[str]) -> None:
        """A knob of another family (`given`: the names a request sets) is a RequestError naming it."""
        takes = self.knobs()
        for key in sorted(given):
            if key not in takes:
                which = f"it takes {sorted(takes)}" if takes else "it takes none of the family-specific knobs"
                raise RequestError(key, f"model {self.name} ({self.family}) does not take {key}; {which}",
                                   code="unsupported_parameter")

    @property
    def min_steps(self) -> int:
        """The fewest steps that make a schedule: 2 for a flow-match scheduler that stretches its sigmas to end at
        `shift_terminal` (Qwen-Image, LTX), whose one-step schedule is the lone sigma 1.0, which the stretch divides
        by zero (diffusers computes a NaN sigma: a black image); else 1."""
        return 2 if self.pipe.scheduler.config.get("shift_terminal") else 1

    def check_steps(self, steps: int | None) -> None:
        if steps is not None and steps < self.min_steps:
            terminal = self.pipe.scheduler.config.get("shift_terminal")
            raise RequestError("num_inference_steps", f"num_inference_steps must be at least {self.min_steps} for "
                                                      f"model {self.name}: its scheduler ends the schedule at "
                                                      f"shift_terminal {terminal:g}, which one step cannot reach; "
                                                      f"got {steps}")

    # -- facts the API layer needs --------------------------------------------------------
    @property
    def pipe(self):
        """The pipeline the checkpoint was loaded as; the variants share its modules."""
        return next(iter(self.pipes.values()))

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t.value for t in self.pipes)

    @property
    def size_factor(self) -> int:
        """Width and height must be multiples of this."""
        raise NotImplementedError

    # -- per-request objects ----------------------------------------------------------------
    def new_scheduler(self):
        """A scheduler private to one request: its position never lives on a shared object."""
        base = self.pipe.scheduler
        return type(base).from_config(base.config)

    def view(self, task: Task | VideoTask, scheduler):
        """A shallow copy of the task's pipeline whose scheduler belongs to one request."""
        view = copy.copy(self.pipes[task])
        object.__setattr__(view, "scheduler", scheduler)  # bypass register_to_config: the view is private
        return view

    def begin(self, item: WorkItem) -> tuple[RequestT, dict, Any, Any, torch.Generator]:
        """A request's parameters and conditioning, and its private scheduler, pipeline view and generator."""
        req: RequestT = item.inputs["request"]
        scheduler = self.new_scheduler()
        assert req.seed is not None  # validate() drew one
        return req, item.inputs["cond"], scheduler, self.view(req.task, scheduler), self.generator(req.seed)

    def generator(self, seed: int) -> torch.Generator:
        # Seeds mean what diffusers means with torch.Generator("cpu").manual_seed(seed).
        return torch.Generator("cpu").manual_seed(seed)

    # -- text_encode ------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        """The token ids of every tokenizer the family uses (the prompt cache identity)."""
        raise NotImplementedError

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        """Embeddings of one prompt, batch size 1, no guidance."""
        raise NotImplementedError

    def conditioning(self, prompt: dict, negative: dict | None, request: RequestT) -> dict[str, Any]:
        """Per-request conditioning for the denoiser (guidance halves, repeated n times)."""
        raise NotImplementedError

    def uses_negative(self, request: RequestT) -> bool:
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0

    def text_options(self, request: RequestT) -> dict[str, Any]:
        """Encoder settings of a request that change the embeddings (they enter the cache identity)."""
        return {}

    def negative(self, request: RequestT, prompt: dict, options: dict) -> dict | None:
        """The unconditional half: the encoded negative prompt ("" when none), or None without guidance."""
        if not self.uses_negative(request):
            return None
        return self.cached_text(request.negative_prompt or "", request.tenant, options, getattr(request, "lora", ()))

    def cached_text(self, text: str, tenant: str, options: dict | None = None,
                    lora: tuple = ()) -> dict[str, torch.Tensor]:
        """One prompt's embeddings through the prompt cache; `lora` (adapter, weight) pairs enter its identity (an
        adapter of the text encoder changes the embeddings) and apply to the encode."""
        from stages.lora import rows_use

        options = options or {}
        key = (tenant, self.weights_id, str(self.dtype), self.text_key(text, **options), tuple(sorted(options.items())),
               self.loras.identity(lora))

        def encode() -> dict[str, torch.Tensor]:
            with self.loras.using([name for name, _ in lora]), rows_use([lora]):
                return self.encode_text(text, **options)
        return self.prompt_cache.get_or_compute(key, encode)

    @torch.inference_mode()
    def encode_prompts(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        out = []
        for item in items:
            req: RequestT = item.inputs["request"]
            options = self.text_options(req)
            with counting_lookups() as lookups:
                prompt = self.cached_text(req.prompt, req.tenant, options, getattr(req, "lora", ()))
                negative = self.negative(req, prompt, options)
            if item.trace is not None:
                item.trace.cache(lookups.hits, lookups.misses)
            out.append({"cond": self.conditioning(prompt, negative, req)})
        return out

    # -- denoise: each family's loop body (the DiffusionAdapter contract) ---------------------
    def prepare(self, item: WorkItem) -> None:
        """denoise start: the request's scheduler, timesteps and initial latents into item.state."""
        raise NotImplementedError

    def denoise_key(self, item: WorkItem) -> Hashable:
        """Items with equal keys share one denoiser forward."""
        raise NotImplementedError

    def forward(self, items: list[WorkItem]) -> list[Any]:
        """One batched denoiser call over items that may sit at different timesteps."""
        raise NotImplementedError

    def commit(self, item: WorkItem, model_output: Any) -> None:
        """Guidance and the scheduler step for one item; advances item.state['i']."""
        raise NotImplementedError

    def preview(self, item: WorkItem) -> Any:
        """A decoded picture of the current latents (costs a VAE decode)."""
        raise NotImplementedError

    # -- denoise helpers shared by the families -----------------------------------------------
    @staticmethod
    def guide(model_output: torch.Tensor, cfg: bool, scale: float) -> torch.Tensor:
        if not cfg:
            return model_output
        uncond, cond = model_output.chunk(2)
        return uncond + scale * (cond - uncond)

    @staticmethod
    def split(batched: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(batched, sizes))

    # -- vae_decode -------------------------------------------------------------------------
    def decode_key(self, item: WorkItem) -> Hashable:
        """Items with equal keys share one VAE decode."""
        raise NotImplementedError

    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        """vae_decode: latents -> each item's outputs (one batched VAE call)."""
        raise NotImplementedError
