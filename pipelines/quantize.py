"""Quantized weights per pipeline component, through the field's libraries (`[models.quantize]`, keyed by the
component names of the checkpoint's model_index.json):

    int8wo          torchao int8 weight-only (Linear weights int8 with a scale per output row)   CPU and CUDA
    fp8             torchao float8 weight-only                                                  CUDA
    int4wo          torchao int4 weight-only (groups of 128)                                    CUDA
    nf4             bitsandbytes 4-bit NormalFloat                                              CUDA
    gguf:FILE       a GGUF file of the component (the community's Flux and Wan transformer       CPU and CUDA
                    files; any quantization type GGUF has), loaded by diffusers' single-file
                    loader and dequantized per layer on the fly

diffusers' `PipelineQuantizationConfig` applies the torchao and bitsandbytes methods while the checkpoint loads
(diffusers components with diffusers' config class, transformers components with transformers'); a GGUF component
is loaded first with `from_single_file(FILE, quantization_config=GGUFQuantizationConfig(...))` and handed to
the pipeline. The model's `path` still gives every other component.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TORCHAO = {"int8wo": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig", "int4wo": "Int4WeightOnlyConfig"}
METHODS = (*TORCHAO, "nf4", "gguf:FILE")
NEEDS_CUDA = ("fp8", "int4wo", "nf4")


@dataclass(frozen=True)
class Quantization:
    """One model's methods: component -> "int8wo" | "fp8" | "int4wo" | "nf4" | "gguf:/abs/file.gguf"."""

    methods: dict[str, str]

    def check(self, model: str, device: str) -> None:
        """Start-up checks that need no checkpoint: known methods, CUDA-only methods on a CUDA device, GGUF files
        that exist."""
        for component, method in self.methods.items():
            where = f"model {model}: quantize.{component} = {method!r}"
            if method.startswith("gguf:"):
                if not Path(method[5:]).is_file():
                    raise ValueError(f"{where}: no such GGUF file")
                continue
            if method not in TORCHAO and method != "nf4":
                raise ValueError(f"{where}: unknown method; methods: {list(METHODS)}")
            if method in NEEDS_CUDA and not str(device).startswith("cuda"):
                raise ValueError(f"{where} needs a CUDA device (this model is on {device}); on the CPU, int8wo and "
                                 "gguf run")

    def load_kwargs(self, path: str, dtype: torch.dtype) -> dict[str, Any]:
        """What the pipeline's from_pretrained takes for these methods: a quantization_config for the torchao and
        bitsandbytes ones, the loaded module for each GGUF one."""
        libraries = components_of(path)
        unknown = sorted(set(self.methods) - set(libraries))
        if unknown:
            raise ValueError(f"quantize names {unknown}, which are not weight components of {path}; its components: "
                             f"{sorted(libraries)}")
        out: dict[str, Any] = {}
        mapping = {}
        for component, method in self.methods.items():
            library, class_name = libraries[component]
            if method.startswith("gguf:"):
                out[component] = _gguf_component(path, component, library, class_name, method[5:], dtype)
            else:
                mapping[component] = _config(library, method)
        if mapping:
            from diffusers.quantizers import PipelineQuantizationConfig

            out["quantization_config"] = PipelineQuantizationConfig(quant_mapping=mapping)
        return out


def components_of(path: str) -> dict[str, tuple[str, str]]:
    """The weight components of a diffusers checkpoint: name -> (library, class name), from model_index.json
    (schedulers and tokenizers have no weights)."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return {name: (value[0], value[1]) for name, value in index.items()
            if isinstance(value, list) and len(value) == 2 and value[0] in ("diffusers", "transformers")
            and not value[1].endswith(("Scheduler", "Tokenizer", "TokenizerFast", "Processor", "FeatureExtractor"))}


def _config(library: str, method: str):
    if method == "nf4":
        if library == "diffusers":
            from diffusers import BitsAndBytesConfig
        else:
            from transformers import BitsAndBytesConfig  # type: ignore[assignment]
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    import torchao.quantization as ao

    config = getattr(ao, TORCHAO[method])()
    if library == "diffusers":
        from diffusers import TorchAoConfig

        return TorchAoConfig(config)
    from transformers import TorchAoConfig as TransformersTorchAoConfig

    return TransformersTorchAoConfig(config)


def _gguf_component(path: str, component: str, library: str, class_name: str, file: str, dtype: torch.dtype):
    import diffusers
    from diffusers import GGUFQuantizationConfig

    cls = getattr(diffusers, class_name, None) if library == "diffusers" else None
    if cls is None or not hasattr(cls, "from_single_file"):
        raise ValueError(f"quantize.{component}: {class_name} does not load from a single GGUF file (diffusers' "
                         "single-file loader has the Flux, Wan, SD3, LTX and other transformers)")
    try:
        module = cls.from_single_file(file, quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                      config=path, subfolder=component, torch_dtype=dtype)
    except Exception as exc:  # gguf and diffusers raise many kinds (bad file, missing keys, shape mismatch)
        raise ValueError(f"quantize.{component}: {file} does not load as {class_name}: {type(exc).__name__}: "
                         f"{exc}") from exc
    for param in module.parameters():  # plain (F32, F16, BF16) tensors: out of the file's buffer into memory of
        if type(param) is torch.nn.Parameter:  # their own, aligned as torch aligns (matmuls round the same)
            param.data = param.data.clone()
    return module


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, looking inside tensor subclasses (torchao's quantized weights: int8 data and scales)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = flatten(tensor)
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each shared tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor_bytes(tensor)
    return total


def quantized_methods(quantization: Quantization | None) -> dict[str, str]:
    """What /v1/models reports: component -> method ("gguf" for a GGUF file, without its path)."""
    if quantization is None:
        return {}
    return {c: ("gguf" if m.startswith("gguf:") else m) for c, m in quantization.methods.items()}
