"""LoRA per row (stages/lora.py) on the tiny demo Stable Diffusion: adapters loaded with diffusers'
`load_lora_weights` from files in diffusers' format (random low-rank weights built here), mixed per row of one
forward, each row equal to diffusers with that row's adapters activated by `set_adapters` (not fused)."""

from __future__ import annotations

import pytest
import torch

from stages.lora import mix_lora_layers, rows_use
from tests.helpers import demo_path

ATOL = 1e-5  # the gathered rows' matmuls may round differently from the whole batch's (measured below 1e-6)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return demo_path(tmp_path_factory, "sd")


def save_lora(pipe_path: str, out, seed: int, unet: dict, text: dict | None = None) -> str:
    """A LoRA file in diffusers' format (pytorch_lora_weights.safetensors with its PEFT config as metadata):
    random A and B for the UNet (and the text encoder) layers the configs target."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(pipe_path)
    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for key, model, spec in (("unet", pipe.unet, unet), ("text_encoder", pipe.text_encoder, text)):
        if spec is None:
            continue
        config = LoraConfig(**spec, init_lora_weights=False)
        inject_adapter_in_model(config, model)
        with torch.no_grad():  # lora_B starts at zero in PEFT: make it count
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0, 0.2)
        layers[f"{key}_lora_layers"] = get_peft_model_state_dict(model)
        metadata[f"{key}_lora_adapter_metadata"] = config.to_dict()
    StableDiffusionPipeline.save_lora_weights(str(out), **layers, **metadata)
    return str(out)


@pytest.fixture(scope="module")
def loras(sd, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    a = save_lora(sd, root / "a", 1, dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                  dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    b = save_lora(sd, root / "b", 2, dict(r=2, lora_alpha=2, target_modules=["to_k", "to_v", "ff.net.2"]))
    return {"a": a, "b": b}


def pipeline(sd: str, loras: dict[str, str]):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(sd)
    for name, path in loras.items():
        pipe.load_lora_weights(path, adapter_name=name)
    return pipe


ROWS = ((("a", 0.7),), (("b", 1.0),), (), (("a", 0.5), ("b", 1.2)))  # A, B, none, A+B


def test_rows_with_different_adapters_share_one_unet_forward(sd, loras):
    """Four rows, four adapter sets, one forward: each row equals diffusers' UNet with that row's set active."""
    ref, ours = pipeline(sd, loras), pipeline(sd, loras)
    assert mix_lora_layers(ours.unet) > 0
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 4, 8, 8, generator=generator)
    text = torch.randn(4, 77, ours.unet.config.cross_attention_dim, generator=generator)
    t = torch.tensor(500)
    with torch.no_grad(), rows_use(ROWS):
        mixed = ours.unet(latents, t, encoder_hidden_states=text).sample
    for i, use in enumerate(ROWS):
        if use:
            ref.set_adapters([name for name, _ in use], [weight for _, weight in use])
            ref.enable_lora()
        else:
            ref.disable_lora()
        with torch.no_grad():
            alone = ref.unet(latents[i:i + 1], t, encoder_hidden_states=text[i:i + 1]).sample
        torch.testing.assert_close(mixed[i:i + 1], alone, rtol=0, atol=ATOL)
    with torch.no_grad():  # no plan: the base model (the adapters' weights are loaded, and unused)
        ref.disable_lora()
        torch.testing.assert_close(ours.unet(latents, t, encoder_hidden_states=text).sample,
                                   ref.unet(latents, t, encoder_hidden_states=text).sample, rtol=0, atol=0)
    assert not torch.allclose(mixed[0], mixed[2], atol=1e-3)  # the adapters do change the output


def test_one_request_through_the_whole_pipeline_equals_set_adapters(sd, loras):
    """A one-row plan applies to every row: the text encoder's LoRA and the UNet's (both guidance halves) for a
    whole diffusers pipeline call, equal to diffusers with `set_adapters(["a", "b"], [0.8, 0.4])`."""
    ref, ours = pipeline(sd, loras), pipeline(sd, loras)
    assert mix_lora_layers(ours.unet) > 0 and mix_lora_layers(ours.text_encoder) > 0  # A's text encoder layers
    ref.set_adapters(["a", "b"], [0.8, 0.4])
    call = dict(prompt="a red bicycle", num_inference_steps=3, height=64, width=64, output_type="np")
    want = ref(**call, generator=torch.Generator().manual_seed(5)).images
    with rows_use([(("a", 0.8), ("b", 0.4))]):
        got = ours(**call, generator=torch.Generator().manual_seed(5)).images
    plain = ours(**call, generator=torch.Generator().manual_seed(5)).images
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=ATOL)
    assert abs(got - plain).max() > 1e-3


def test_a_plan_must_describe_every_row(sd, loras):
    ours = pipeline(sd, loras)
    mix_lora_layers(ours.unet)
    latents, text = torch.randn(3, 4, 8, 8), torch.randn(3, 77, ours.unet.config.cross_attention_dim)
    with pytest.raises(RuntimeError, match="plan of 2 rows for a forward of 3"), torch.no_grad():
        with rows_use([(("a", 1.0),), ()]):
            ours.unet(latents, torch.tensor(10), encoder_hidden_states=text)
