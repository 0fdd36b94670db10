"""A tiny checkpoint of a diffusers pipeline class mmserve has no family for (PixArt-Sigma: T5 + DiT), served by the
diffusers fallback (pipelines/fallback.py): random weights, built offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_pixart_sigma(out: str | Path, seed: int = 0) -> str:
    """A PixArtSigmaPipeline at `out`: a 2-layer T5 encoder, a 2-layer DiT (sample size 32: PixArt's resolution
    binning knows it), a four-block VAE that keeps those 32 latent px, DPM-Solver++."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from pipelines.demo import _seeded, _t5_tokenizer, _vae

    tokenizer = _t5_tokenizer()
    text_encoder = _seeded(seed, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)))
    transformer = _seeded(seed, lambda: PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=32, patch_size=2, caption_channels=32, norm_num_groups=8))
    vae = _seeded(seed, lambda: _vae((8, 8, 8, 8), 4))
    pipe: Any = PixArtSigmaPipeline(  # (Any: mypy sees diffusers' lazy exports as dummies)
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=DPMSolverMultistepScheduler())
    pipe.save_pretrained(out)
    return str(out)
