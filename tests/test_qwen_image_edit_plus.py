"""Qwen-Image-Edit-Plus through the engine and a real server: instruction edits of one or several input images equal
to diffusers' QwenImageEditPlusPipeline, batched across requests; several images refused where the model edits one
(or past the limit), naming `image`."""

import base64
import io

import numpy as np
import openai
import pytest
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from PIL import Image

from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from tests.helpers import demo_path, running_engine, seeded
from tests.test_serve_support import Server, read_image

# __call__ resizes every input for the VAE (and sizes the output) at 1024 * 1024 pixels: 16k context tokens each on
# the tiny checkpoint. Requests here ask for target_area AREA; the reference's calculate_dimensions gets the same
# area in place of 1024 * 1024 (the text encoder's 384 * 384 stays).
AREA = 48 * 32
FULL = 1024 * 1024


def input_image(seed: int = 0, size=(60, 40)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def plus_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen_image_edit_plus")


@pytest.fixture(scope="module")
def engine(plus_path):
    with running_engine(plus_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(plus_path):
    pipe = QwenImageEditPlusPipeline.from_pretrained(plus_path)
    pipe.set_progress_bar_config(disable=True)
    original = pipeline_qwenimage_edit_plus.calculate_dimensions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_qwenimage_edit_plus, "calculate_dimensions",
                      lambda area, ratio: original(AREA if area == FULL else area, ratio))
        yield pipe


def _edit(image, **kwargs) -> ImageRequest:
    return ImageRequest(task=Task.IMAGE_TO_IMAGE, image=image, extra={"target_area": AREA}, **kwargs)


def _reference(reference, image, prompt, steps, seed, **kwargs) -> np.ndarray:
    return reference(image=image, prompt=prompt, num_inference_steps=steps, generator=seeded(seed), output_type="np",
                     **kwargs).images


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "qwen_image" and set(info.tasks) == {"image-to-image"}
    assert engine.family("m").several_images


@pytest.mark.parametrize("count,negative", [(1, None), (2, None), (2, "blurry")])
def test_edit_equals_diffusers(engine, reference, count, negative):
    """One or two input images (of different sizes) go through the text encoder ("Picture 1: ... Picture 2: ...")
    and the VAE as context latents; the output takes the last image's size at target_area. A negative prompt guides
    with true CFG."""
    images = [input_image(1), input_image(2, (40, 56))][:count]
    prompt = "put the cat from picture 1 on the sofa of picture 2"
    request = _edit(images if count > 1 else images[0], prompt=prompt, negative_prompt=negative, n=2,
                    num_inference_steps=3, guidance_scale=3.0, seed=7)
    got = engine.submit_image("m", request).result(timeout=180)
    ref = _reference(reference, images, prompt, 3, 7, negative_prompt=negative, true_cfg_scale=3.0,
                     num_images_per_prompt=2)
    assert got["pixels"].shape == ref.shape == (2, 32, 64 if count == 1 else 32, 3)  # the last image's at AREA
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)


def test_concurrent_edits_share_forwards_and_equal_diffusers(engine, reference):
    """Two two-image edits of the same sizes at different step counts share the transformer's forwards, each equal
    to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=2, seed=1, image=[input_image(3), input_image(4)]),
             dict(prompt="a tan door", num_inference_steps=3, seed=2, image=[input_image(5), input_image(6)])]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", _edit(**spec)) for spec in specs]
    ours = [h.result(timeout=180)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = _reference(reference, spec["image"], spec["prompt"], spec["num_inference_steps"], spec["seed"])
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_the_prompt_cache_keys_every_image(engine):
    """The embeddings depend on all the images, in order: another second image, or the two swapped, is another
    entry; the same list again reuses its entry."""
    family = engine.family("m")
    a, b, c = input_image(7), input_image(8), input_image(9)
    for images, miss in [([a, b], 1), ([a, c], 1), ([b, a], 1), ([a, b], 0)]:
        misses = family.prompt_cache.stats.misses
        engine.submit_image("m", _edit(images, prompt="add snow", num_inference_steps=2, seed=5)).result(timeout=120)
        assert family.prompt_cache.stats.misses == misses + miss, images


def test_too_many_images_name_the_field_and_the_limit(engine):
    limit = ImageLimits().max_images
    for images, says in [([input_image(i) for i in range(limit + 1)], f"the limit is {limit}"),
                         ([], "empty list")]:
        with pytest.raises(RequestError) as err:
            engine.submit_image("m", _edit(images, prompt="x", num_inference_steps=2))
        assert err.value.param == "image" and says in err.value.message


# -- through a real server and the official openai client -----------------------------------------------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory, plus_path):
    from pipelines.demo import build_demo_model

    edit_path = build_demo_model("qwen_image_edit", tmp_path_factory.mktemp("qedit") / "qwen_image_edit")
    config = (f'[[models]]\nname = "qplus"\npath = "{plus_path}"\n\n'
              f'[[models]]\nname = "qedit"\npath = "{edit_path}"\n\n[limits]\nmax_images = 3\n')
    server = Server(tmp_path_factory.mktemp("qplus-serve"), config)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)
    finally:
        server.stop()


def test_multi_image_edit_through_the_openai_client(client, reference):
    """client.images.edit(image=[f1, f2]) sends `image[]` parts: the server edits both, equal to the pipeline's."""
    images = [input_image(10), input_image(11, (40, 56))]
    result = client.images.edit(model="qplus", image=[("a.png", png(images[0]), "image/png"),
                                                      ("b.png", png(images[1]), "image/png")],
                                prompt="blend them", extra_body={"target_area": AREA, "num_inference_steps": 2,
                                                                 "seed": 3})
    got = np.asarray(read_image(base64.b64decode(result.data[0].b64_json)).convert("RGB")).astype(np.int16)
    want = _reference(reference, images, "blend them", 2, 3)[0]
    assert got.shape == want.shape
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1


def test_http_refusals_name_image(client):
    """A model that edits one image refuses two (400 naming image, before any decode); past [limits] max_images the
    server refuses before reading further."""
    files = [("a.png", png(input_image(i)), "image/png") for i in range(4)]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(model="qedit", image=files[:2], prompt="x", extra_body={"target_area": AREA})
    assert err.value.body["param"] == "image" and "limit is 1" in err.value.body["message"], err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(model="qplus", image=files, prompt="x", extra_body={"target_area": AREA})
    assert err.value.body["param"] == "image" and "the limit is 3" in err.value.body["message"], err.value.body
    # a list of one is one image to the single-image model
    result = client.images.edit(model="qedit", image=files[:1], prompt="x",
                                extra_body={"target_area": AREA, "num_inference_steps": 2, "seed": 1})
    assert result.data[0].b64_json


def test_json_edit_with_several_image_references(client, reference):
    """The JSON form: several `images` references (data: URIs here) are the same list of images."""
    import httpx

    images = [input_image(12), input_image(13)]
    refs = [{"image_url": "data:image/png;base64," + base64.b64encode(png(image)).decode()} for image in images]
    reply = httpx.post(f"{client.base_url}images/edits", timeout=120, json={
        "model": "qplus", "prompt": "swap them", "images": refs, "target_area": AREA, "num_inference_steps": 2,
        "seed": 4})
    assert reply.status_code == 200, reply.text
    got = np.asarray(read_image(base64.b64decode(reply.json()["data"][0]["b64_json"])).convert("RGB")).astype(np.int16)
    want = _reference(reference, images, "swap them", 2, 4)[0]
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1
    too_many = httpx.post(f"{client.base_url}images/edits", timeout=60, json={
        "model": "qplus", "prompt": "x", "images": refs * 2, "target_area": AREA})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "images", too_many.text
    assert "the limit is 3" in too_many.json()["error"]["message"]
