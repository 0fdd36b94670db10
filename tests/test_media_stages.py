"""The media stages as graph nodes: the server's image requests end in media_encode, its edits start with
media_decode, and /metrics shows every node."""

from __future__ import annotations

import io

import httpx
import pytest
from PIL import Image

from pipelines.image_request import ImageRequest, RequestError, Task
from serve.errors import http_status
from stages.events import EventKind, StageError
from stages.media.stage import DecodeImages, EncodeImages
from tests.helpers import running_engine


@pytest.fixture(scope="module")
def engine(sd_path):
    with running_engine(sd_path, name="sd") as eng:
        yield eng


def _samples(engine, name: str, stage: str) -> float:
    """A stage series of the model's pool (labels: stage = the pool, model/kind)."""
    return engine.metrics.registry.get_sample_value(name, {"stage": f"sd/{stage}", "model": "sd"}) or 0.0


def test_encoded_output_runs_the_media_encode_node(engine):
    before = _samples(engine, "mmserve_stage_run_seconds_count", "media_encode")
    request = ImageRequest("a red bicycle", n=2, num_inference_steps=2, seed=3, output=EncodeImages("jpeg", 80))
    handle = engine.submit("sd", request)
    events = list(handle.events(timeout=300))
    started = [e.stage for e in events if e.kind is EventKind.STAGE_STARTED]
    assert started == ["text_encode", "denoise", "vae_decode", "media_encode"]
    outputs = events[-1].data["outputs"]
    assert outputs["seed"] == 3 and len(outputs["images"]) == 2 and len(outputs["encoded"]) == 2
    for image, data in zip(outputs["images"], outputs["encoded"], strict=True):
        decoded = Image.open(io.BytesIO(data))
        assert decoded.format == "JPEG" and decoded.size == image.size
    # the same bytes the engine's own encoder makes
    assert outputs["encoded"] == engine.encode_images(outputs["images"], "jpeg", 80)
    assert _samples(engine, "mmserve_stage_run_seconds_count", "media_encode") == before + 1
    assert _samples(engine, "mmserve_stage_queue_age_seconds_count", "media_encode") >= 1


def test_pixel_output_has_no_media_encode_node(engine):
    before = _samples(engine, "mmserve_stage_run_seconds_count", "media_encode")
    events = list(engine.submit("sd", ImageRequest("a red bicycle", num_inference_steps=1, seed=1)).events(timeout=300))
    assert [e.stage for e in events if e.kind is EventKind.STAGE_STARTED] == ["text_encode", "denoise", "vae_decode"]
    assert "encoded" not in events[-1].data["outputs"]
    assert _samples(engine, "mmserve_stage_run_seconds_count", "media_encode") == before


def test_encode_task_checks_its_quality():
    with pytest.raises(ValueError, match="quality"):
        EncodeImages("jpeg", 101)
    assert EncodeImages("png").quality is None


def _png(width: int, height: int) -> bytes:
    from tests.helpers import noise_image

    out = io.BytesIO()
    noise_image(64, seed=5).resize((width, height)).save(out, format="PNG")
    return out.getvalue()


def test_an_edit_decodes_in_its_graph_and_equals_an_edit_of_the_decoded_image(engine):
    data = _png(70, 66)  # size auto: the edit keeps the upload's size rounded down to the model's multiple
    request = ImageRequest("repaint", task=Task.IMAGE_TO_IMAGE, num_inference_steps=2, seed=7,
                           source=DecodeImages(data), output=EncodeImages("png"))
    events = list(engine.submit("sd", request).events(timeout=300))
    started = [e.stage for e in events if e.kind is EventKind.STAGE_STARTED]
    assert started == ["media_decode", "text_encode", "denoise", "vae_decode", "media_encode"]
    outputs = events[-1].data["outputs"]
    assert outputs["images"][0].size == (64, 64)
    given = engine.decode_image(data, param="image")  # the same edit of the same decode, without the node
    direct = engine.submit("sd", ImageRequest("repaint", task=Task.IMAGE_TO_IMAGE, num_inference_steps=2, seed=7,
                                              image=given, width=64, height=64)).result(timeout=300)
    assert outputs["images"][0].tobytes() == direct["images"][0].tobytes()
    assert _samples(engine, "mmserve_stage_run_seconds_count", "media_decode") >= 1


def test_a_corrupt_upload_fails_in_media_decode_naming_its_field(engine):
    request = ImageRequest("repaint", task=Task.INPAINTING, num_inference_steps=2,
                           source=DecodeImages(_png(64, 64), b"not a png", image_param="images"))
    handle = engine.submit("sd", request)
    with pytest.raises(StageError) as err:
        handle.result(timeout=300)
    assert (err.value.code, err.value.param, http_status(err.value)) == ("media_corrupt", "mask", 400)
    events = list(handle.events(timeout=10))
    assert [e.stage for e in events if e.kind is EventKind.STAGE_STARTED] == ["media_decode"]


def test_an_edit_is_checked_before_its_upload_is_decoded(engine):
    before = _samples(engine, "mmserve_stage_run_seconds_count", "media_decode")
    with pytest.raises(RequestError) as err:
        engine.submit("sd", ImageRequest("repaint", task=Task.IMAGE_TO_IMAGE, n=99, source=DecodeImages(b"x")))
    assert err.value.param == "n"
    assert _samples(engine, "mmserve_stage_run_seconds_count", "media_decode") == before


def test_a_streamed_edit_with_a_corrupt_upload_answers_400_before_streaming(tmp_path, sd_path):
    from tests.test_serve_support import Server

    server = Server(tmp_path, f'[[models]]\nname = "sd"\npath = "{sd_path}"\n')
    try:
        files = {"image": ("in.png", b"\x89PNG not really", "image/png")}
        data = {"model": "sd", "prompt": "repaint", "num_inference_steps": "2", "stream": "true"}
        r = httpx.post(f"{server.url}/v1/images/edits", data=data, files=files, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text
        assert r.json()["error"]["code"] == "media_corrupt"
        good = httpx.post(f"{server.url}/v1/images/edits", data={**data, "stream": "false"}, timeout=120,
                          files={"image": ("in.png", _png(64, 64), "image/png")})
        assert good.status_code == 200, good.text
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for kind in ("media_decode", "text_encode", "denoise", "vae_decode", "media_encode"):
            assert f'mmserve_stage_run_seconds_count{{model="sd",stage="sd/{kind}"}}' in text, kind
    finally:
        server.stop()


def test_a_chat_with_an_image_is_one_graph_where_llm_reads_its_prompt_and_its_features(tmp_path):
    import base64

    from pipelines.chat import ChatRequest, LLMConfig
    from pipelines.demo import build_demo_model
    from stages.llm.params import SamplingParams

    path = str(build_demo_model("llava", tmp_path / "llava"))
    uri = "data:image/png;base64," + base64.b64encode(_png(90, 60)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "what is it?"}]}]
    params = SamplingParams(temperature=0, max_tokens=3)
    with running_engine(path, name="vlm", llm=LLMConfig(kv_cache_mb=8)) as eng:
        handle = eng.submit_chat("vlm", ChatRequest(messages=messages, params=params))
        events = list(handle.events(timeout=300))
        assert [e.stage for e in events if e.kind is EventKind.STAGE_STARTED] == ["media_decode", "vision_encode",
                                                                                  "llm"]
        assert events[-1].kind is EventKind.FINAL and len(events[-1].data["outputs"]["choices"][0]["token_ids"]) == 3
        for kind in ("media_decode", "vision_encode", "llm"):
            labels = {"stage": f"vlm/{kind}", "model": "vlm"}
            assert eng.metrics.registry.get_sample_value("mmserve_stage_run_seconds_count", labels) >= 1, kind
        # a corrupt image is still refused at submit, naming its part, before anything is encoded
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(StageError) as err:
            eng.submit_chat("vlm", ChatRequest(messages=bad, params=params))
        assert err.value.param == "messages[0].content[0].image_url.url" and http_status(err.value) == 400


def test_an_edits_own_fields_are_checked_with_its_real_task_before_decoding(engine):
    before = _samples(engine, "mmserve_stage_run_seconds_count", "media_decode")
    for fields, param in (({"strength": 1.5}, "strength"), ({"num_inference_steps": 0}, "num_inference_steps"),
                          ({"width": 60, "height": 64}, "size"), ({"guidance_scale": -1.0}, "guidance_scale")):
        request = ImageRequest("repaint", task=Task.IMAGE_TO_IMAGE, source=DecodeImages(b"x"), **fields)
        with pytest.raises(RequestError) as err:
            engine.check_image("sd", request)
        assert err.value.param == param, fields
    # Unset size, steps and guidance are the image's and the family's: checked after the decode, not refused now.
    engine.check_image("sd", ImageRequest("repaint", task=Task.INPAINTING, source=DecodeImages(b"x", b"y")))
    assert _samples(engine, "mmserve_stage_run_seconds_count", "media_decode") == before
