"""Qwen2.5-Omni's vocoder with the zero-stuffed upsampler (pipelines/omni_bigvgan.py) equals transformers' up to float
summation order: each upsampler alone, and the whole BigVGAN of the demo checkpoint's shape on a random mel."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.mark.parametrize("ratio, kernel", [(2, 12), (2, None), (3, None), (4, 8)])
def test_the_stuffed_upsampler_equals_the_transposed_convolution(ratio, kernel):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniUpSample1d

    from pipelines.omni_bigvgan import StuffedUpSample1d

    theirs = Qwen2_5OmniUpSample1d(ratio, kernel)
    ours = StuffedUpSample1d(theirs)
    x = torch.randn(3, 5, 97, generator=torch.Generator().manual_seed(ratio))
    want = theirs(x)
    got = ours(x)
    assert got.shape == want.shape == (3, 5, 97 * ratio)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_vocoder_with_stuffed_upsamplers_equals_transformers():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    from pipelines.omni_bigvgan import StuffedUpSample1d, register

    config = Qwen2_5OmniBigVGANConfig(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3, 7],
                                      resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
                                      upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    torch.manual_seed(0)
    theirs = Qwen2_5OmniToken2WavBigVGANModel(config).eval()
    with torch.no_grad():  # weights at std 1/sqrt(fan-in), the last conv scaled down: a waveform, not silence
        for module in theirs.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.weight.normal_(0.0, module.weight[0].numel() ** -0.5)
        theirs.conv_post.weight.mul_(1 / 64)
    ours = copy.deepcopy(theirs)
    swapped = register(ours)
    assert swapped == sum(isinstance(m, StuffedUpSample1d) for m in ours.modules()) > 0
    mel = torch.randn(2, 80, 40, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = theirs(mel), ours(mel)
    assert got.shape == want.shape and want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
