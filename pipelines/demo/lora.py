"""Random LoRA adapters for the demo checkpoints, in the formats users bring: diffusers' (a directory with
pytorch_lora_weights.safetensors and its PEFT config as metadata), kohya's / A1111's single file, and PEFT's
adapter directory for language models. Seeded; the low-rank updates are large enough to change the output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def _randomize(model: torch.nn.Module, std: float) -> None:
    """PEFT starts lora_B at zero (no change): draw every LoRA weight instead."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, std)


def build_diffusion_lora(pipeline_path: str, out: str | Path, seed: int, targets: dict[str, dict[str, Any]],
                         std: float = 0.2) -> str:
    """A diffusers-format LoRA of the pipeline at `pipeline_path`: `targets` maps a component ("unet",
    "transformer", "text_encoder") to its LoraConfig fields (r, lora_alpha, target_modules)."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = DiffusionPipeline.from_pretrained(pipeline_path)
    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for component, fields in targets.items():
        config = LoraConfig(**fields, init_lora_weights=False)
        module = getattr(pipe, component)
        inject_adapter_in_model(config, module)
        _randomize(module, std)
        layers[f"{component}_lora_layers"] = get_peft_model_state_dict(module)
        metadata[f"{component}_lora_adapter_metadata"] = config.to_dict()
    type(pipe).save_lora_weights(str(out), **layers, **metadata)
    return str(out)


def to_kohya(diffusers_dir: str | Path, out: str | Path) -> str:
    """The same SD-family adapter in kohya's (A1111's) key format: lora_unet_* / lora_te_* modules with lora_down,
    lora_up and an alpha tensor each."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
    tensors = {}
    with safe_open(f"{diffusers_dir}/pytorch_lora_weights.safetensors", "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
        for key in f.keys():
            component, rest = key.split(".", 1)
            path, kind = rest.rsplit(".lora_", 1)
            module = prefixes[component] + path.replace(".", "_")
            tensors[f"{module}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"] = f.get_tensor(key)
            tensors[f"{module}.alpha"] = torch.tensor(float(metadata[f"{component}.lora_alpha"]))
    save_file(tensors, str(out))
    return str(out)


def build_llm_lora(model_path: str, out: str | Path, seed: int, std: float = 0.5, **fields: Any) -> str:
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) of the causal LM at
    `model_path`; `fields`: LoraConfig's (r, lora_alpha, target_modules)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                           LoraConfig(**fields, init_lora_weights=False, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    model.save_pretrained(str(out))
    return str(out)
