"""The diffusers fallback (pipelines/fallback.py): a diffusers pipeline class with no native family is served through
its own `__call__`. Tiny random checkpoints built here: PixArt-Sigma (T5 + DiT; the older `callback` step hook) and
Stable Diffusion with PAG (`callback_on_step_end`). Each answer equals the pipeline's own call with the same seed."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest, RequestError, Task
from stages.events import EventKind, StageError
from tests.helpers import demo_path, noise_image, running_engine, seeded

REQUEST = dict(prompt="a red bicycle", negative_prompt="blurry", width=32, height=32, num_inference_steps=3,
               guidance_scale=3.0, seed=5)


def _call(path: str, cls_name: str, **request):
    """The pipeline's own __call__ on a fresh copy of the checkpoint: pixels [n, H, W, 3]."""
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    seed, n = request.pop("seed"), request.pop("n", 1)
    return pipe(**request, num_images_per_prompt=n, generator=seeded(seed), output_type="np").images


@pytest.fixture(scope="module")
def pixart(tmp_path_factory) -> str:
    from pipelines.demo.fallback import build_pixart_sigma

    return build_pixart_sigma(tmp_path_factory.mktemp("pixart") / "pixart")


@pytest.fixture(scope="module")
def sd(tmp_path_factory) -> str:
    return demo_path(tmp_path_factory, "sd")


@pytest.fixture(scope="module")
def pag(sd, tmp_path_factory) -> str:
    """The demo SD's components saved as a StableDiffusionPAGPipeline (a class with no native family)."""
    from diffusers import StableDiffusionPAGPipeline

    path = tmp_path_factory.mktemp("pag") / "pag"
    StableDiffusionPAGPipeline.from_pretrained(sd).save_pretrained(path)
    return str(path)


def test_a_pipeline_answers_as_its_own_call_and_models_say_how_they_run(pixart, sd):
    """Detected from model_index.json (family diffusers, execution pipeline; the native SD beside it: stage-graph);
    a request equals PixArtSigmaPipeline's own call, one PROGRESS per step; defaults come from its __call__; what
    it cannot do is a RequestError naming the field."""
    from serve.models import model_object

    engine = Engine(EngineConfig(models=(ModelSpec("pixart", pixart), ModelSpec("sd", sd))))
    engine.start()
    try:
        info = engine.models["pixart"]
        assert (info.family, info.execution, info.tasks) == ("diffusers", "pipeline", ("text-to-image",))
        assert model_object(info, 0)["execution"] == "pipeline"
        assert model_object(engine.models["sd"], 0)["execution"] == "stage-graph"

        handle = engine.submit_image("pixart", ImageRequest(**REQUEST, n=2))
        progress = [(e.data["step"], e.data["total"]) for e in handle.events() if e.kind is EventKind.PROGRESS]
        out = handle.result()
        assert progress == [(1, 3), (2, 3), (3, 3)]
        want = _call(pixart, "PixArtSigmaPipeline", **REQUEST, n=2)
        assert out["pixels"].shape == (2, 32, 32, 3) and out["seed"] == 5 and len(out["images"]) == 2
        np.testing.assert_allclose(out["pixels"], want, atol=1e-5)

        checked = engine._served["pixart"].check(ImageRequest(prompt="x"))  # PixArtSigmaPipeline.__call__'s defaults
        defaults = (checked.num_inference_steps, checked.guidance_scale, checked.width, checked.height)
        assert defaults == (20, 4.5, 256, 256)
        bad = [({"width": 40, "height": 32}, "size"), ({"num_inference_steps": 0}, "num_inference_steps"),
               ({"lora": (("a", None),)}, "lora"), ({"previews": 1}, "partial_images"),
               ({"preview_every": 1}, "preview_every"),
               ({"extra": {"output_type": "pil"}}, "extra.output_type"),
               ({"task": Task.IMAGE_TO_IMAGE, "image": noise_image(32)}, "model")]
        for fields, param in bad:
            with pytest.raises(RequestError) as refused:
                engine.submit_image("pixart", ImageRequest(prompt="x", **fields))
            assert refused.value.param == param, fields
    finally:
        engine.shutdown()


def test_progress_per_step_and_a_cancel_stops_at_the_next_step(pag):
    """callback_on_step_end reports every step; a cancel during step 2 ends the call when step 2 ends (no third
    denoiser forward), the request ends cancelled, and the next request still equals the pipeline's own call."""
    with running_engine(pag, name="pag") as engine:
        handle = engine.submit_image("pag", ImageRequest(**{**REQUEST, "num_inference_steps": 4}))
        progress = [(e.data["step"], e.data["total"]) for e in handle.events() if e.kind is EventKind.PROGRESS]
        assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]

        unet, forwards, submitted, running = engine._served["pag"].model.unet, [], threading.Event(), {}

        def cancel_in_step_two(module, args, output):  # in the worker thread, inside the pipeline's call
            forwards.append(1)
            if len(forwards) == 2:
                submitted.wait(30)
                running["handle"].cancel()

        hook = unet.register_forward_hook(cancel_in_step_two)
        try:
            running["handle"] = engine.submit_image("pag", ImageRequest(**{**REQUEST, "num_inference_steps": 100}))
            submitted.set()
            with pytest.raises(StageError) as info:
                running["handle"].result(timeout=60)
            assert info.value.code == "cancelled"
            pool = engine.executor.pools["pag/pipeline"]
            for _ in range(3000):
                if pool.idle:
                    break
                threading.Event().wait(0.01)
            assert pool.idle
        finally:
            hook.remove()
        assert len(forwards) == 2  # (PAG runs the UNet once a step: CFG and perturbed rows in one batch)

        request = {**REQUEST, "extra": {"pag_scale": 1.5}}  # a __call__ knob of the pipeline's own
        out = engine.submit_image("pag", ImageRequest(**request)).result(timeout=60)
        want = _call(pag, "StableDiffusionPAGPipeline", **REQUEST, pag_scale=1.5)
        np.testing.assert_allclose(out["pixels"], want, atol=1e-5)


def test_images_through_the_server_and_the_openai_client(pixart, tmp_path):
    """/v1/models says execution "pipeline"; images.generate returns PixArt's image (PNG, the media_encode stage);
    an edit is the usual 400 unsupported_task."""
    import base64
    import io

    import httpx
    import openai
    from PIL import Image

    from tests.test_serve_support import Server, png_bytes

    server = Server(tmp_path, f'[[models]]\nname = "pixart"\npath = "{pixart}"\n')
    try:
        models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
        assert (models["pixart"]["family"], models["pixart"]["execution"]) == ("diffusers", "pipeline")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.images.generate(model="pixart", prompt=REQUEST["prompt"], size="32x32", extra_body={
            "negative_prompt": "blurry", "num_inference_steps": 3, "guidance_scale": 3.0, "seed": 5})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))).convert("RGB"))
        want = _call(pixart, "PixArtSigmaPipeline", **REQUEST)[0]
        assert got.shape == (32, 32, 3) and np.abs(got.astype(float) - np.round(want * 255)).max() <= 1
        with pytest.raises(openai.BadRequestError) as info:
            client.images.edit(model="pixart", image=("a.png", png_bytes(32, 32), "image/png"), prompt="x")
        assert info.value.body["code"] == "unsupported_task"
    finally:
        server.stop()


def _refusal(path, **spec) -> str:
    """The ValueError an engine serving `path` stops with at start."""
    engine = Engine(EngineConfig(models=(ModelSpec("m", str(path), **spec),)))
    try:
        with pytest.raises(ValueError) as info:
            engine.start()
    finally:
        engine.shutdown()
    return str(info.value)


def test_custom_code_and_other_classes_are_refused_at_start(tmp_path):
    """A class diffusers does not define, a diffusers class that is no pipeline, custom pipeline code (never
    imported), a component of another library, a pipeline that needs an input image, and custom_pipeline /
    trust_remote_code in the config: each a clear error at start naming it."""
    from serve.config import load_config

    def checkpoint(name: str, index: dict, **files: str):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps(index))
        for file, text in files.items():
            (folder / file).write_text(text)
        return folder

    marker = tmp_path / "imported"
    custom = checkpoint("custom", {"_class_name": ["my_pipeline", "MyPipeline"]},
                        **{"my_pipeline.py": f"open({str(marker)!r}, 'w').write('ran')\n"})
    for path, spec, says in (
            (checkpoint("unknown", {"_class_name": "MyPipeline"}), {}, "'MyPipeline', which is not a diffusers"),
            (checkpoint("model", {"_class_name": "AutoencoderKL"}), {}, "'AutoencoderKL', which is not a diffusers"),
            (custom, {}, "custom pipeline code ['my_pipeline', 'MyPipeline']"),
            (custom, {"family": "diffusers"}, "custom pipeline code ['my_pipeline', 'MyPipeline']"),
            (checkpoint("component", {"_class_name": "PixArtSigmaPipeline",
                                      "transformer": ["my_transformer", "MyTransformer"]}), {},
             "component 'transformer' is ['my_transformer', 'MyTransformer'], code from the checkpoint"),
            (checkpoint("img2img", {"_class_name": "StableDiffusionPAGImg2ImgPipeline"}), {},
             "StableDiffusionPAGImg2ImgPipeline cannot be served through its own __call__: it takes ['image']")):
        assert says in _refusal(path, **spec)
    assert not marker.exists()  # the checkpoint's code never ran
    for key, value in (("custom_pipeline", '"my_pipeline"'), ("trust_remote_code", "true")):
        config = tmp_path / f"{key}.toml"
        config.write_text(f'[[models]]\nname = "m"\npath = "{custom}"\n{key} = {value}\n')
        with pytest.raises(ValueError, match=f"{key}: mmserve never runs code from a checkpoint"):
            load_config(config)
