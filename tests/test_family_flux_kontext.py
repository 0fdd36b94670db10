"""FLUX.1 Kontext through the engine: in-context edits and text-to-image equal to diffusers' FluxKontextPipeline,
batched across requests, and edits through /v1/images/edits."""

import base64

import numpy as np
import openai
import pytest
from diffusers import FluxKontextPipeline
from PIL import Image

from pipelines.image_request import ImageRequest, RequestError, Task
from tests.helpers import demo_path, running_engine, seeded
from tests.test_serve_support import Server, png_bytes, read_image

# The tiny checkpoint packs 8 px into one token: a 40 x 24 context image is 15 tokens beside the noise's.
WIDTH, HEIGHT = 40, 24
NO_RESIZE = {"auto_resize": False}  # the context image as it is (diffusers' _auto_resize=False): a few tokens


def context_image(width: int = WIDTH, height: int = HEIGHT, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def kontext_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "flux_kontext")


@pytest.fixture(scope="module")
def engine(kontext_path):
    with running_engine(kontext_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(kontext_path):
    pipe = FluxKontextPipeline.from_pretrained(kontext_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(engine, **kwargs):
    return engine.submit_image("m", ImageRequest(**kwargs)).result(timeout=120)


def _edit(image, **kwargs) -> ImageRequest:
    return ImageRequest(task=Task.IMAGE_TO_IMAGE, image=image, extra=dict(NO_RESIZE), **kwargs)


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "flux_kontext"
    assert set(info.tasks) == {"text-to-image", "image-to-image"}


@pytest.mark.parametrize("negative,true_cfg", [(None, 1.0), ("blurry", 2.5)])
def test_edit_equals_diffusers(engine, reference, negative, true_cfg):
    """The input image is context: its latents ride beside the noise; the output keeps the image's size."""
    image = context_image()
    request = _edit(image, prompt="make it blue", negative_prompt=negative, n=2, num_inference_steps=3,
                    guidance_scale=4.0, seed=11)
    request.extra["true_cfg_scale"] = true_cfg
    ours = engine.submit_image("m", request).result(timeout=120)
    ref = reference(image=image, prompt="make it blue", negative_prompt=negative, true_cfg_scale=true_cfg,
                    num_images_per_prompt=2, height=HEIGHT, width=WIDTH, max_area=WIDTH * HEIGHT,
                    num_inference_steps=3, guidance_scale=4.0, generator=seeded(11), output_type="np",
                    _auto_resize=False).images
    assert ours["pixels"].shape == (2, HEIGHT, WIDTH, 3) and ours["seed"] == 11
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_edits_share_forwards_and_equal_diffusers(engine, reference):
    """Two edits of the same size at different step counts share the denoiser's forwards, each still equal to its
    own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1, image=context_image(seed=1)),
             dict(prompt="a green door", num_inference_steps=4, seed=2, image=context_image(seed=2))]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", _edit(**spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = reference(image=spec["image"], prompt=spec["prompt"], height=HEIGHT, width=WIDTH,
                        max_area=WIDTH * HEIGHT, num_inference_steps=spec["num_inference_steps"],
                        generator=seeded(spec["seed"]), output_type="np", _auto_resize=False).images
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_text_to_image_equals_diffusers(engine, reference):
    """Without an image Kontext generates; max_area fits the size to an area at the asked aspect ratio."""
    ours = _run(engine, prompt="a lighthouse", width=32, height=48, num_inference_steps=3, seed=5,
                extra={"max_area": 32 * 32})
    ref = reference(prompt="a lighthouse", width=32, height=48, max_area=32 * 32, num_inference_steps=3,
                    generator=seeded(5), output_type="np").images
    assert ours["pixels"].shape == ref.shape == (1, 32, 24, 3)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


@pytest.mark.parametrize("extra,param", [({"max_area": 10**9}, "max_area"), ({"max_area": "1024"}, "max_area"),
                                         ({"auto_resize": "no"}, "auto_resize")])
def test_bad_knobs_name_their_field(engine, extra, param):
    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(prompt="x", width=32, height=32, extra=extra))
    assert err.value.param == param


def test_edit_through_the_server(tmp_path_factory, kontext_path):
    """/v1/images/edits with the openai client: the upload is the context image (auto-resized, as diffusers
    does by default), the reply an image of the upload's size."""
    server = Server(tmp_path_factory.mktemp("kontext-serve"), f"""
[[models]]
name = "kontext"
path = "{kontext_path}"
""")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)
        assert set(client.models.retrieve("kontext").model_dump()["tasks"]) >= {"text-to-image", "image-to-image"}
        result = client.images.edit(model="kontext", image=("in.png", png_bytes(WIDTH, HEIGHT), "image/png"),
                                    prompt="make it blue", extra_body={"num_inference_steps": 1, "seed": 3})
        image = read_image(base64.b64decode(result.data[0].b64_json))
        assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
    finally:
        server.stop()
