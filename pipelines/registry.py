"""Model families by name, and detection of a checkpoint's family from its own files."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# family name -> "module:Class"; one file per family in pipelines/families/.
FAMILIES = {
    "sd": "pipelines.families.sd:StableDiffusionFamily",
    "sdxl": "pipelines.families.sdxl:StableDiffusionXLFamily",
    "sd3": "pipelines.families.sd3:StableDiffusion3Family",
    "flux": "pipelines.families.flux:FluxFamily",
    "flux_kontext": "pipelines.families.flux_kontext:FluxKontextFamily",
    "flux2": "pipelines.families.flux2:Flux2Family",
    "flux2_klein": "pipelines.families.flux2_klein:Flux2KleinFamily",
    "wan": "pipelines.families.wan:WanFamily",  # video (pipelines/video.py)
    "ltx": "pipelines.families.ltx:LTXFamily",
    "cogvideox": "pipelines.families.cogvideox:CogVideoXFamily",
    "hunyuan_video": "pipelines.families.hunyuan_video:HunyuanVideoFamily",
    "hunyuan_video15": "pipelines.families.hunyuan_video15:HunyuanVideo15Family",
    "ltx2": "pipelines.families.ltx2:LTX2Family",
    "qwen_image": "pipelines.families.qwen_image:QwenImageFamily",
    "sana": "pipelines.families.sana:SanaFamily",
    "z_image": "pipelines.families.z_image:ZImageFamily",
}
DIFFUSERS_FALLBACK = "diffusers"  # the family of a diffusers pipeline class with no native family
# family name -> "module:Class" of its served model (pipelines/served.py): how the engine loads and runs it.
SERVED = {
    **{family: "pipelines.served_diffusion:ServedDiffusion" for family in FAMILIES},
    "causal-lm": "pipelines.served:ServedChat",
    "embedding": "pipelines.served:ServedEmbedding",
    "clip-embedding": "pipelines.served:ServedEmbedding",
    "vlm": "pipelines.served:ServedVLM",
    "vits": "pipelines.served:ServedSpeech",
    "speecht5": "pipelines.served:ServedSpeech",
    "whisper": "pipelines.served:ServedTranscription",
    # any other diffusers pipeline class, run through its own __call__ (pipelines/fallback.py)
    DIFFUSERS_FALLBACK: "pipelines.fallback:ServedPipeline",
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(SERVED)
# config.json `architectures` served as vision-language chat models (pipelines/vlm.py, encoders/ADAPTERS).
VLM_ARCHITECTURES = {"LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                     "Qwen2_5_VLForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
                     "Qwen2_5OmniForConditionalGeneration"}
# config.json `architectures` served as embeddings (pipelines/embeddings.py): bare text encoders
# (mean pooling) and CLIP. A sentence-transformers checkpoint (modules.json) is "embedding" whatever its architecture.
TEXT_EMBEDDING_ARCHITECTURES = {"BertModel", "RobertaModel", "XLMRobertaModel", "MPNetModel", "DistilBertModel",
                                "ModernBertModel"}
CLIP_EMBEDDING_ARCHITECTURES = {"CLIPModel"}
# config.json `architectures` served as text-to-speech (pipelines/tts.py) -> family.
TTS_ARCHITECTURES = {"VitsModel": "vits", "SpeechT5ForTextToSpeech": "speecht5"}
# config.json `architectures` served as speech recognition (pipelines/asr.py).
ASR_ARCHITECTURES = {"WhisperForConditionalGeneration"}

# model_index.json `_class_name` -> family. Listed here (not imported from the family files) so
# that detection stays cheap and works before any family module is importable.
CLASS_NAMES = {
    "StableDiffusionPipeline": "sd", "StableDiffusionImg2ImgPipeline": "sd", "StableDiffusionInpaintPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl", "StableDiffusionXLImg2ImgPipeline": "sdxl",
    "StableDiffusionXLInpaintPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3", "StableDiffusion3Img2ImgPipeline": "sd3",
    "StableDiffusion3InpaintPipeline": "sd3",
    "FluxPipeline": "flux", "FluxImg2ImgPipeline": "flux", "FluxInpaintPipeline": "flux",
    "FluxKontextPipeline": "flux_kontext",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2_klein",
    "QwenImagePipeline": "qwen_image", "QwenImageEditPipeline": "qwen_image", "QwenImageEditPlusPipeline": "qwen_image",
    "SanaPipeline": "sana",
    "ZImagePipeline": "z_image",
    "WanPipeline": "wan", "WanImageToVideoPipeline": "wan", "LTXPipeline": "ltx", "LTXImageToVideoPipeline": "ltx",
    "CogVideoXPipeline": "cogvideox", "CogVideoXImageToVideoPipeline": "cogvideox",
    "HunyuanVideoPipeline": "hunyuan_video",
    "HunyuanVideo15Pipeline": "hunyuan_video15", "HunyuanVideo15ImageToVideoPipeline": "hunyuan_video15",
    "LTX2Pipeline": "ltx2",
}


def diffusers_pipeline_class(name: str) -> type | None:
    """The diffusers pipeline class called `name` (a DiffusionPipeline subclass diffusers itself defines), else None.
    Imports diffusers and that pipeline's module, nothing of the checkpoint."""
    import diffusers

    cls = getattr(diffusers, name, None) if name.isidentifier() else None
    # (a pipeline whose optional dependency is missing is a dummy object, not a DiffusionPipeline subclass)
    base = diffusers.DiffusionPipeline
    return cls if isinstance(cls, type) and issubclass(cls, base) and cls is not base else None


def family_class(family: str):
    """The diffusion family class (pipelines/families/) of `family`."""
    return _imported(FAMILIES, family)


def served_class(family: str):
    """The served-model class (pipelines/served.py) that loads and runs a model of `family`."""
    return _imported(SERVED, family)


def _imported(table: dict[str, str], family: str):
    if family not in table:
        raise ValueError(f"unknown model family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    module, cls = table[family].split(":")
    return getattr(importlib.import_module(module), cls)


def _read_index(path: str) -> tuple[dict | None, dict | None]:
    """model_index.json and config.json of a local directory or a hub id (hub only from the local cache)."""
    found = []
    for name in ("model_index.json", "config.json"):
        local = Path(path) / name
        if local.is_file():
            found.append(json.loads(local.read_text()))
            continue
        if Path(path).exists():
            found.append(None)
            continue
        try:
            from huggingface_hub import hf_hub_download
            found.append(json.loads(Path(hf_hub_download(path, name)).read_text()))
        except Exception:  # not on the hub cache: the caller reports what it found
            found.append(None)
    return found[0], found[1]


def _has_file(path: str, name: str) -> bool:
    """Whether a local directory, or a hub id in the local cache, holds `name`."""
    if Path(path).exists():
        return (Path(path) / name).is_file()
    try:
        from huggingface_hub import hf_hub_download
        hf_hub_download(path, name)
        return True
    except Exception:  # not cached (the server is offline) or not in that repository
        return False


def detect_family(path: str) -> str:
    """The family of a checkpoint from model_index.json `_class_name` or config.json `architectures`."""
    if _has_file(path, "modules.json"):
        return "embedding"  # sentence-transformers: its own files say how to pool and normalise
    index, config = _read_index(path)
    supported = ", ".join(f"{f} ({', '.join(sorted(c for c, fam in CLASS_NAMES.items() if fam == f))})"
                          for f in SUPPORTED_FAMILIES)
    if index is None and config is None:
        raise ValueError(f"{path}: no model_index.json or config.json found (a local directory or a cached hub id). "
                         f"Supported families: {supported}")
    if index is not None:
        name = index.get("_class_name", "")
        if not isinstance(name, str):  # [module, class]: a pipeline whose code ships with the checkpoint
            raise ValueError(f"{path}: model_index.json names custom pipeline code {name!r}; mmserve never runs code "
                             "from a checkpoint or the hub (custom_pipeline, trust_remote_code)")
        if name in CLASS_NAMES:
            return CLASS_NAMES[name]
        if diffusers_pipeline_class(name) is not None:
            return DIFFUSERS_FALLBACK  # its components' code is checked when it loads (pipelines/fallback.py)
        raise ValueError(f"{path}: model_index.json names {name!r}, which is not a diffusers pipeline class mmserve "
                         f"can serve. Supported: {supported}; or any other diffusers pipeline class (family "
                         f"{DIFFUSERS_FALLBACK!r}: run through its own __call__)")
    arch = (config or {}).get("architectures") or []
    if any(a in VLM_ARCHITECTURES for a in arch):
        return "vlm"
    if any(a.endswith("ForCausalLM") for a in arch):
        return "causal-lm"  # any transformers decoder LM (Llama, Qwen2, Mistral, Gemma, Phi, ...)
    if any(a in CLIP_EMBEDDING_ARCHITECTURES for a in arch):
        return "clip-embedding"
    if any(a in TEXT_EMBEDDING_ARCHITECTURES for a in arch):
        return "embedding"
    if any(a in ASR_ARCHITECTURES for a in arch):
        return "whisper"
    tts = [TTS_ARCHITECTURES[a] for a in arch if a in TTS_ARCHITECTURES]
    if tts:
        return tts[0]
    raise ValueError(f"{path}: config.json architectures {arch} are not a supported family. Supported: {supported}")
