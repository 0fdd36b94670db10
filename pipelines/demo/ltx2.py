"""A tiny, seeded, random-weight LTX-2 audio+video checkpoint (LTX2Pipeline, LTX-2's layout).

    family  pipeline      latents for 17 frames at 64 x 64 (24 fps)
    ltx2    LTX2Pipeline  video [4, 3, 4, 4] (VAE: 16x spatial incl. patch 2, 8x temporal); audio [2, 18, 2]
                          -> 0.71 s of 16 kHz stereo (the vocoder upsamples the mel frames by their hop, 160)

Every component is LTX-2's kind: a Gemma 3 text encoder (Gemma3ForConditionalGeneration, its hidden states of every
layer stacked) with a byte-level BPE tokenizer trained in-process (pipelines/demo/llm.py), the text connectors,
the audio-video transformer (LTX2VideoTransformer3DModel), the video VAE (AutoencoderKLLTX2Video), the audio VAE
(mel spectrograms) and the vocoder. Sizes follow diffusers' own LTX-2 test components, with a deeper video VAE so
the demo's 64 px videos stay a few dozen tokens.
"""

from __future__ import annotations

from pipelines.demo.video import _seeded


def _gemma3(seed: int, vocab_size: int, pad_token_id: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                            sliding_window=64, pad_token_id=pad_token_id)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=vocab_size - 1)
    return _seeded(seed, lambda: Gemma3ForConditionalGeneration(config))


def _audible(vocoder):
    """He-initialised convolutions without biases: the vocoder's own small init leaves a random one's output its
    biases (the same sound whatever the latents); this one's depends on them, so tests can tell soundtracks apart."""
    import torch

    for module in vocoder.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            torch.nn.init.kaiming_normal_(module.weight, a=0.1, nonlinearity="leaky_relu")
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    return vocoder


def build_ltx2(seed: int, scale: str):
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from pipelines.demo.llm import chat_tokenizer

    tokenizer = chat_tokenizer()
    text_encoder = _gemma3(seed, len(tokenizer) + 1, tokenizer.pad_token_id)
    text_hidden, text_layers = 32, 2
    transformer = _seeded(seed, lambda: LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=text_hidden, rope_double_precision=False, rope_type="split",
        perturbed_attn=True))  # self-attention STG can skip (LTX-2.3's; off, STG perturbs nothing)
    connectors = _seeded(seed, lambda: LTX2TextConnectors(
        caption_channels=text_hidden, text_proj_in_factor=text_layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split"))

    def video_vae():
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8),
            decoder_block_out_channels=(8, 8, 8), layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False,) * 4, downsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3,
            upsample_factor=(1,) * 3, timestep_conditioning=False, patch_size=2, patch_size_t=1, encoder_causal=True,
            decoder_causal=False)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        return vae

    audio_vae = _seeded(seed, lambda: AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8))
    vocoder = _seeded(seed, lambda: _audible(LTX2Vocoder(
        # upsampling by 5 * 4 * 4 * 2 = 160, the mel hop: the soundtrack lasts as long as the video
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[10, 8, 8, 4],
        upsample_factors=[5, 4, 4, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000)))
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-2's: the shift grows with the video's token count
        shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=_seeded(seed, video_vae), audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)
