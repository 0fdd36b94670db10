"""Real-size architectures with random weights, saved as checkpoints both mmserve and diffusers/transformers load.

* sd15: Stable Diffusion 1.5's UNet (860M), CLIP ViT-L text encoder and VAE.
* flux: FLUX.1-dev's transformer (19 double + 38 single blocks, 12B), CLIP-L, the 16-channel VAE, and a T5
  of T5-XXL's width with `t5_layers` of its 24 layers (the text encoder runs once per prompt and is cached;
  the benchmark times the denoiser).
* llama7b: Llama-2-7B's shape (32 layers, 4096 wide, 32000 vocab).
Weights are initialised on the GPU in the target dtype, so a 12B model builds in seconds; the
tokenizers are mmserve's tiny demo tokenizers (the token ids reach the real-size embeddings).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

STAMP = "mmserve_bench.json"


@contextlib.contextmanager
def _init_on(device: str, dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _built(out: Path, stamp: dict) -> bool:
    return (out / STAMP).exists() and json.loads((out / STAMP).read_text()) == stamp


def build(name: str, out: str | Path, *, device: str = "cuda", dtype: str = "bfloat16", **options) -> Path:
    """Build `name` (sd15, flux, llama7b) into `out` once; returns the directory."""
    out = Path(out)
    stamp = {"name": name, "dtype": dtype, **options}
    if _built(out, stamp):
        return out
    torch.manual_seed(0)
    with _init_on(device, getattr(torch, dtype)):
        model = {"sd15": _sd15, "flux": _flux, "llama7b": _llama7b}[name](**options)
    model.save_pretrained(out)
    (out / STAMP).write_text(json.dumps(stamp))
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def _clip_text(tokenizer, hidden: int = 768, layers: int = 12, heads: int = 12, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                            projection_dim=hidden, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=latent_channels, layers_per_block=2,
                         sample_size=512, **extra)


def _sd15():
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    from pipelines.demo import _clip_tokenizer

    tokenizer = _clip_tokenizer()
    unet = UNet2DConditionModel(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                                block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
                                attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=_vae(4), text_encoder=_clip_text(tokenizer), tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def _flux(double: int = 19, single: int = 38, t5_layers: int = 2):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from pipelines.demo import _clip_tokenizer, _t5_tokenizer

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=4096, d_kv=64, d_ff=10240, num_layers=t5_layers,
                                 num_heads=64, feed_forward_proj="gated-gelu", pad_token_id=tokenizer_2.pad_token_id,
                                 eos_token_id=tokenizer_2.eos_token_id))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=double, num_single_layers=single,
                                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    vae = _vae(16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=_clip_text(tokenizer), tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=tokenizer_2, transformer=transformer)


def _llama7b(layers: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.demo.llm import Checkpoint, chat_tokenizer

    tokenizer = chat_tokenizer()
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return Checkpoint(model, tokenizer)
