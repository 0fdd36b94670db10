"""The family knobs as HTTP extension fields (max_sequence_length, true_cfg_scale, max_area, target_area on the image
endpoints; true_cfg_scale on /v1/videos), through a real server and the official openai client (`extra_body=`): each
reaches the pipeline (the output is the diffusers pipeline's called with that argument), and a bad value or a knob
the model's family does not take is a 400 naming the field."""

from __future__ import annotations

import base64
import io
import time

import av
import numpy as np
import openai
import pytest
from diffusers import FluxKontextPipeline, HunyuanVideoPipeline, QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from tests.helpers import seeded
from tests.test_serve_support import Server, read_image

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the openai client on videos


def noise_png(width: int, height: int, seed: int = 0) -> tuple[Image.Image, bytes]:
    rng = np.random.RandomState(seed)
    image = Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return image, buf.getvalue()


def as_uint8(pixels: np.ndarray) -> np.ndarray:
    return (pixels * 255).round().astype(np.int16)  # as the server encodes its pixels (pipelines/families/base.py)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("knob-models")
    return {f: str(build_demo_model(f, root / f)) for f in ("flux_kontext", "qwen_image_edit", "hunyuan_video",
                                                            "cogvideox")}


@pytest.fixture(scope="module")
def client(tmp_path_factory, paths):
    names = {"kontext": "flux_kontext", "qedit": "qwen_image_edit", "hunyuan": "hunyuan_video", "cog": "cogvideox"}
    config = "".join(f'[[models]]\nname = "{name}"\npath = "{paths[family]}"\n\n' for name, family in names.items())
    server = Server(tmp_path_factory.mktemp("knob-serve"), config)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)
    finally:
        server.stop()


def _reference(pipe_class, path: str):
    pipe = pipe_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux_kontext_knobs_reach_the_pipeline(client, paths):
    """max_area fits the output (32x48 asked, 24x32 made), max_sequence_length cuts T5's tokens and true_cfg_scale
    guides with the negative prompt: the image is FluxKontextPipeline's called with all three."""
    result = client.images.generate(model="kontext", prompt="a lighthouse", size="32x48", extra_body={
        "negative_prompt": "blurry", "num_inference_steps": 2, "seed": 5,
        "max_area": 32 * 32, "max_sequence_length": 16, "true_cfg_scale": 2.0})
    got = np.asarray(read_image(base64.b64decode(result.data[0].b64_json)).convert("RGB")).astype(np.int16)
    ref = _reference(FluxKontextPipeline, paths["flux_kontext"])
    common = dict(prompt="a lighthouse", negative_prompt="blurry", width=32, height=48, num_inference_steps=2,
                  output_type="np")
    want = ref(**common, max_area=32 * 32, max_sequence_length=16, true_cfg_scale=2.0, generator=seeded(5)).images
    assert got.shape == (32, 24, 3)
    assert np.abs(got - as_uint8(want[0])).max() <= 1  # float error may round one level apart
    # and each knob changes the image beyond that rounding: none was dropped on the way
    for other in (dict(max_sequence_length=16, true_cfg_scale=1.0), dict(max_sequence_length=512, true_cfg_scale=2.0)):
        image = ref(**common, max_area=32 * 32, **other, generator=seeded(5)).images[0]
        assert np.abs(got - as_uint8(image)).max() >= 4


def test_qwen_image_edit_target_area_reaches_the_pipeline(client, paths):
    """target_area sizes the input image (QwenImageEditPipeline's calculate_dimensions at that area): the 60x40 upload
    at 48*32 pixels makes a 64x32 edit, equal to the pipeline's."""
    image, data = noise_png(60, 40)
    result = client.images.edit(model="qedit", image=("in.png", data, "image/png"), prompt="make it purple",
                                extra_body={"target_area": 48 * 32, "num_inference_steps": 2, "seed": 7})
    got = np.asarray(read_image(base64.b64decode(result.data[0].b64_json)).convert("RGB")).astype(np.int16)
    ref = _reference(QwenImageEditPipeline, paths["qwen_image_edit"])
    original = pipeline_qwenimage_edit.calculate_dimensions
    with pytest.MonkeyPatch.context() as patch:  # the pipeline's __call__ fixes the area at 1024**2
        patch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(48 * 32, ratio))
        want = ref(image=image, prompt="make it purple", num_inference_steps=2, generator=seeded(7),
                   output_type="np").images
    assert got.shape == (32, 64, 3)
    assert np.abs(got - as_uint8(want[0])).max() <= 1


def _video(client, model: str, **extra) -> np.ndarray:
    """A finished /v1/videos job's MP4, decoded: uint8 [F, H, W, 3]."""
    job = client.videos.create(model=model, prompt="a red bicycle", size="32x32",  # type: ignore[arg-type]
                               extra_body={"num_frames": 9, "num_inference_steps": 3, "seed": 11, **extra})
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = client.videos.retrieve(job.id)
    assert job.status == "completed", job
    data = client.videos.download_content(job.id).read()
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)


def test_hunyuan_video_true_cfg_scale_reaches_the_pipeline(client, paths):
    """The MP4 is lossy, and on tiny noise frames by far more than one level: compared by the means of 8x8 blocks,
    the served video is the pipeline's with true_cfg_scale 20 up to the codec's error, and several times that far
    from the pipeline's without true CFG."""
    got = _video(client, "hunyuan", negative_prompt="blurry", true_cfg_scale=20.0)
    ref = _reference(HunyuanVideoPipeline, paths["hunyuan_video"])
    common = dict(prompt="a red bicycle", negative_prompt="blurry", width=32, height=32, num_frames=9,
                  num_inference_steps=3, output_type="np")
    want = ref(**common, true_cfg_scale=20.0, generator=seeded(11)).frames[0]
    off = ref(**common, true_cfg_scale=1.0, generator=seeded(11)).frames[0]
    assert got.shape == want.shape == (9, 32, 32, 3)

    def blocks(video: np.ndarray) -> np.ndarray:  # [F, 4, 4, 3]: each 8x8 block's mean, 0..255
        return video.reshape(9, 4, 8, 4, 8, 3).mean(axis=(2, 4))

    codec_error = np.abs(blocks(got) - blocks(as_uint8(want))).mean()
    knob_effect = np.abs(blocks(got) - blocks(as_uint8(off))).mean()
    assert codec_error < 4 and knob_effect > 2.5 * codec_error, (codec_error, knob_effect)


@pytest.mark.parametrize("model, fields, param, says", [
    ("kontext", {"target_area": 4096}, "target_area", "does not take target_area"),
    ("kontext", {"max_area": 10**9}, "max_area", "1048576"),  # the limit: the server's max_pixels
    ("kontext", {"max_sequence_length": 4096}, "max_sequence_length", "between 1 and 512"),
    ("kontext", {"max_sequence_length": 0}, "max_sequence_length", "greater than or equal to 1"),
    ("kontext", {"true_cfg_scale": 99}, "true_cfg_scale", "between 0 and 50"),
])
def test_image_generation_refusals_name_the_field(client, model, fields, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=model, prompt="x", size="32x32", extra_body={"num_inference_steps": 1, **fields})
    assert err.value.status_code == 400 and err.value.param == param
    assert says in err.value.message


@pytest.mark.parametrize("fields, param, says", [
    ({"max_area": 2048}, "max_area", "does not take max_area"),
    ({"max_sequence_length": 64}, "max_sequence_length", "does not take max_sequence_length"),  # edits cut nothing
    ({"target_area": "big"}, "target_area", "integer"),
])
def test_image_edit_refusals_name_the_field(client, fields, param, says):
    _, data = noise_png(60, 40)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(model="qedit", image=("in.png", data, "image/png"), prompt="x",
                           extra_body={"num_inference_steps": 1, **fields})
    assert err.value.status_code == 400 and err.value.param == param
    assert says in err.value.message


@pytest.mark.parametrize("model, fields, says", [
    ("cog", {"true_cfg_scale": 2.0}, "does not take true_cfg_scale"),
    ("hunyuan", {"true_cfg_scale": 99}, "between 0 and 50"),
    ("hunyuan", {"true_cfg_scale": -1}, "greater than or equal to 0"),
])
def test_video_refusals_name_the_field(client, model, fields, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model=model, prompt="x", size="32x32",  # type: ignore[arg-type]
                             extra_body={"num_frames": 9, "num_inference_steps": 1, **fields})
    assert err.value.status_code == 400 and err.value.param == "true_cfg_scale"
    assert says in err.value.message
