"""Vision-language chat end to end: greedy answers about images (LLaVA, Qwen2.5-VL) and a video
(Qwen2.5-VL; LLaVA takes its frames as images) equal the model's own generate() with the
processor's inputs, with the encoder cache cold and warm and beside another image request; the
encoder-output cache identity matrix and single flight; bad input refused before encoding."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.video_utils import VideoMetadata

from pipelines.chat import ChatRequest, LLMConfig
from pipelines.chat_parts import VLMConfig
from pipelines.config import EngineConfig, ModelSpec
from pipelines.demo import build_demo_model
from pipelines.engine import Engine
from serve.errors import http_status
from stages.events import StageError
from stages.llm.multimodal import MediaSpan, MRoPE, attach_features, mrope_positions
from stages.llm.params import SamplingParams
from stages.media.video import decode_video, encode_video
from stages.pool import PoolConfig

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=10)
QUESTION = "what is in it?"
LLM = LLMConfig(kv_cache_mb=4, block_size=4, max_num_batched_tokens=64, max_prefill_chunk=8)  # spans cross chunks
# One encoder worker with a window: requests submitted together share an encoder forward.
POOLS = {"vision_encode": PoolConfig(max_batch_size=16, max_delay_ms=50)}


def png(seed: int, width: int = 90, height: int = 60, tweak: bool = False) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    if tweak:
        pixels[0, 0, 0] ^= 1  # one bit of one pixel
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def mp4(seed: int = 0, frames: int = 12, fps: float = 4.0) -> bytes:
    return encode_video((np.random.RandomState(seed).rand(frames, 56, 84, 3) * 255).astype("uint8"), fps=fps)


def uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": uri(data, "image/png"), **extra}}


def video_part(data: bytes, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": uri(data, "video/mp4"), **extra}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {"llava": str(build_demo_model("llava", root / "llava")),
            "qwen": str(build_demo_model("qwen2_5_vl", root / "qwen")),
            "qwen-b": str(build_demo_model("qwen2_5_vl", root / "qwen-b", seed=1)),
            "qwen2vl": str(build_demo_model("qwen2_vl", root / "qwen2vl"))}


@pytest.fixture(scope="module")
def engine(paths):
    vlm = VLMConfig(max_images=3, max_video_frames=8, low_detail_max_pixels=56 * 56)
    specs = (ModelSpec("llava", paths["llava"], llm=LLM, vlm=vlm, pools=POOLS),
             ModelSpec("qwen", paths["qwen"], llm=LLM, vlm=vlm, pools=POOLS),
             ModelSpec("qwen-bf16", paths["qwen"], dtype="bfloat16", llm=LLM, vlm=vlm),
             ModelSpec("qwen-b", paths["qwen-b"], llm=LLM, vlm=vlm),
             ModelSpec("qwen2vl", paths["qwen2vl"], llm=LLM, vlm=vlm))
    eng = Engine(EngineConfig(models=specs))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def references(paths):
    return {name: (AutoModelForImageTextToText.from_pretrained(paths[name]).eval(),
                   AutoProcessor.from_pretrained(paths[name]))
            for name in ("llava", "qwen", "qwen2vl")}


def generate(references, name: str, parts: list[str], images=None, videos=None, n: int = 10,
             **proc_kwargs) -> list[int]:
    """The model's own greedy generate() on the processor's inputs (`parts`: "image" / "video" in order)."""
    model, processor = references[name]
    content = [{"type": p} for p in parts] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=text, images=images, videos=videos, return_tensors="pt", **proc_kwargs)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def chat(engine, model: str, messages, tenant: str = "default", **params) -> dict:
    request = ChatRequest(messages=messages, params=SamplingParams(**{**GREEDY, **params}), tenant=tenant)
    return engine.submit_chat(model, request).result(timeout=120)


def tokens(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def stats(engine) -> tuple[int, int]:
    s = engine.encoder_cache.stats
    return s.hits, s.misses


# -- equivalence with generate() ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llava", "qwen"])
def test_image_answer_equals_generate_cold_warm_and_batched(engine, references, name):
    a, b = png(10), png(11, width=70, height=100)
    expected_a = generate(references, name, ["image"], images=[pil(a)])
    expected_b = generate(references, name, ["image"], images=[pil(b)])
    hits, misses = stats(engine)
    cold = chat(engine, name, user(image_part(a)))
    assert tokens(cold) == expected_a
    assert stats(engine) == (hits, misses + 1)
    warm = chat(engine, name, user(image_part(a)))  # encoder cache hit, prefix cache hit
    assert tokens(warm) == expected_a and warm["usage"]["cached_tokens"] > 0
    assert stats(engine) == (hits + 1, misses + 1)
    # Another image request alongside: one encoder forward for a new image and a cached one, shared llm steps.
    c = png(12, width=64, height=64)
    expected_c = generate(references, name, ["image"], images=[pil(c)])
    stage = engine.chat_model(name).encode_stages["vision_encode"]
    forwards = stage.forwards

    async def together():
        params = SamplingParams(**GREEDY)
        return await asyncio.gather(*(engine.asubmit_chat(name, ChatRequest(messages=user(image_part(x)),
                                                                            params=params))
                                      for x in (b, c, a)))

    outs = [h.result(timeout=120) for h in asyncio.run(together())]
    assert [tokens(o) for o in outs] == [expected_b, expected_c, expected_a]
    assert stage.forwards == forwards + 1  # b and c (both new, one bucket) in one forward; a from the cache


def test_two_images_in_one_message_equal_generate(engine, references):
    a, b = png(20, width=56, height=56), png(21, width=120, height=60)
    for name in ("llava", "qwen", "qwen2vl"):
        expected = generate(references, name, ["image", "image"], images=[pil(a), pil(b)])
        assert tokens(chat(engine, name, user(image_part(a), image_part(b)))) == expected


@pytest.mark.parametrize("name", ["qwen", "qwen2vl"])
def test_qwen_video_answer_equals_generate_cold_and_warm(engine, references, name):
    data = mp4(0)
    decoded = decode_video(data, fps=2.0)
    meta = VideoMetadata(total_num_frames=decoded.frame_count, fps=decoded.fps, frames_indices=list(decoded.indices))
    expected = generate(references, name, ["video"], videos=[decoded.frames.copy()],
                        videos_kwargs=dict(do_sample_frames=False, video_metadata=[meta]))
    hits, misses = stats(engine)
    assert tokens(chat(engine, name, user(video_part(data, fps=2.0)))) == expected
    assert tokens(chat(engine, name, user(video_part(data, fps=2.0)))) == expected
    assert stats(engine) == (hits + 1, misses + 1)
    # An image and the video in one message (Qwen2-VL: image grid positions, then video timing).
    image = png(13)
    expected = generate(references, name, ["image", "video"], images=[pil(image)], videos=[decoded.frames.copy()],
                        videos_kwargs=dict(do_sample_frames=False, video_metadata=[meta]))
    assert tokens(chat(engine, name, user(image_part(image), video_part(data, fps=2.0)))) == expected


def test_llava_takes_video_frames_as_images(engine, references):
    data = mp4(1, frames=8)
    frames = decode_video(data, num_frames=3).frames
    expected = generate(references, "llava", ["image"] * 3, images=[Image.fromarray(f) for f in frames])
    assert tokens(chat(engine, "llava", user(video_part(data, fps=100.0, max_frames=3)))) == expected


def test_qwen_detail_low_is_a_smaller_image(engine, references):
    data = png(30, width=200, height=150)
    low = {"size": {"longest_edge": 56 * 56, "shortest_edge": 56 * 56}}
    expected = generate(references, "qwen", ["image"], images=[pil(data)], images_kwargs=low)
    out_low = chat(engine, "qwen", user(image_part(data, detail="low")))
    out_high = chat(engine, "qwen", user(image_part(data, detail="high")))
    assert tokens(out_low) == expected
    assert out_low["usage"]["prompt_tokens"] < out_high["usage"]["prompt_tokens"]


# -- the encoder-output cache ---------------------------------------------------------------------

def test_cache_identity_matrix(engine):
    image, video = png(40), mp4(2)

    def delta(model, parts, tenant="default") -> tuple[int, int]:
        before = stats(engine)
        chat(engine, model, user(*parts), tenant=tenant, max_tokens=1)
        after = stats(engine)
        return after[0] - before[0], after[1] - before[1]

    HIT, MISS = (1, 0), (0, 1)
    assert delta("qwen", [image_part(image)]) == MISS
    assert delta("qwen", [image_part(image)]) == HIT  # same everything
    assert delta("qwen", [image_part(image, detail="high")]) == HIT  # high is the default budget: same config
    assert delta("qwen", [image_part(png(40, tweak=True))]) == MISS  # pixels
    assert delta("qwen", [image_part(image, detail="low")]) == MISS  # processor config (resolution)
    assert delta("qwen", [image_part(image)], tenant="other") == MISS  # tenant
    assert delta("qwen-bf16", [image_part(image)]) == MISS  # dtype (same checkpoint)
    assert delta("qwen-b", [image_part(image)]) == MISS  # weights
    assert delta("qwen", [video_part(video, fps=2.0)]) == MISS
    assert delta("qwen", [video_part(video, fps=2.0)]) == HIT
    assert delta("qwen", [video_part(video, fps=4.0)]) == MISS  # frame sampling (fps)
    assert delta("qwen-b", [image_part(image)]) == HIT


def test_hit_equals_cache_disabled_output(engine, paths):
    data = png(50)
    chat(engine, "qwen", user(image_part(data)))
    hits = stats(engine)[0]
    warm = chat(engine, "qwen", user(image_part(data)))
    assert stats(engine)[0] == hits + 1
    off = Engine(EngineConfig(models=(ModelSpec("qwen", paths["qwen"], llm=LLM),), encoder_cache_mb=0))
    off.start()
    try:
        for _ in range(2):
            assert tokens(chat(off, "qwen", user(image_part(data)))) == tokens(warm)
        assert len(off.encoder_cache) == 0 and off.chat_model("qwen").encode_stages["vision_encode"].items_encoded == 2
    finally:
        off.shutdown()


def test_eight_concurrent_requests_encode_a_new_image_once(paths, references):
    """Two encoder workers without a window: concurrent misses of one key meet in the cache's single flight."""
    data = png(60)
    expected = generate(references, "llava", ["image"], images=[pil(data)])
    pools = {"vision_encode": PoolConfig(replicas=2, max_batch_size=2)}
    engine = Engine(EngineConfig(models=(ModelSpec("llava", paths["llava"], llm=LLM, pools=pools),)))
    engine.start()
    stage = engine.chat_model("llava").encode_stages["vision_encode"]
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        results[i] = tokens(chat(engine, "llava", user(image_part(data))))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.shutdown()
    assert results == [expected] * 8
    assert stage.items_encoded == 1 and stats(engine) == (7, 1)


# -- bad input, refused before encoding -----------------------------------------------------------

def refused(engine, model, messages, **params) -> StageError:
    with pytest.raises(StageError) as err:
        chat(engine, model, messages, **params)
    assert http_status(err.value) == 400, err.value.message
    return err.value


def test_bad_input_is_refused_before_encoding(engine):
    stage = engine.chat_model("llava").encode_stages["vision_encode"]
    encoded = stage.items_encoded
    image = png(70)
    err = refused(engine, "llava", user(*[image_part(image)] * 4))
    assert err.param == "messages[0].content[3].image_url" and "max_images" in err.message
    err = refused(engine, "llava", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert err.param == "messages[0].content[0].type" and "model llava takes no audio input" in err.message
    err = refused(engine, "llava", [{"role": "user", "content": [{"type": "file", "file": {}}]}])
    assert err.param == "messages[0].content[0].type"
    err = refused(engine, "qwen", user(video_part(mp4(3), max_frames=9)))
    assert err.param == "messages[0].content[0].video_url.max_frames" and "max_video_frames" in err.message
    err = refused(engine, "llava", user(image_part(image, detail="huge")))
    assert err.param == "messages[0].content[0].image_url.detail"
    err = refused(engine, "llava", user(image_part(b"not an image")))
    assert err.param == "messages[0].content[0].image_url.url"
    # The model's placeholder token typed as text would misalign features: refused, never silent.
    err = refused(engine, "llava", [{"role": "user",
                                     "content": [image_part(image), {"type": "text", "text": "<image>"}]}])
    assert err.param == "messages" and "placeholder" in err.message
    err = refused(engine, "qwen", [{"role": "user", "content": "look: <|image_pad|>"}])
    assert err.param == "messages" and "placeholder" in err.message
    # Text that fits alone but not with the image's tokens counted.
    tok = engine.chat_model("llava").tokenizer
    base = len(engine.chat_model("llava")._render(engine.chat_model("llava").parse(
        ChatRequest(messages=[{"role": "user", "content": [image_part(image), {"type": "text", "text": ""}]}])), [[]]))
    unit = len(tok(" x" * 100, add_special_tokens=False).input_ids) // 100
    words = " x" * ((2048 - base - 4) // unit)
    assert 2048 - 16 < len(tok(words, add_special_tokens=False).input_ids) + base < 2048
    err = refused(engine, "llava", [{"role": "user", "content": [image_part(image), {"type": "text", "text": words}]}])
    assert err.code == "context_length_exceeded" and "for images" in err.message
    assert stage.items_encoded == encoded


def test_text_only_chat_on_a_vlm_equals_generate(engine, references):
    model, processor = references["qwen"]
    messages = [{"role": "user", "content": "hello there"}]
    ids = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    expected = model.generate(**ids, max_new_tokens=10, do_sample=False,
                              eos_token_id=None)[0, ids["input_ids"].shape[1]:]
    assert tokens(chat(engine, "qwen", messages)) == expected.tolist()


# -- the language side's pieces -------------------------------------------------------------------

def test_feature_rows_must_match_placeholders():
    spans = (MediaSpan(2, 4, "x"),)
    with pytest.raises(StageError) as err:
        attach_features(spans, [torch.zeros(3, 8)], num_tokens=10, hidden_size=8)
    assert http_status(err.value) == 400 and err.value.code == "media_mismatch"
    with pytest.raises(StageError):
        attach_features(spans, [], num_tokens=10, hidden_size=8)
    with pytest.raises(StageError):
        attach_features((), [torch.zeros(4, 8)], num_tokens=10, hidden_size=8)
    assert attach_features(spans, [torch.ones(4, 8)], num_tokens=10, hidden_size=8)[0].features.sum() == 32


def test_mrope_positions_across_the_prompt_end():
    rope = MRoPE(torch.tensor([[0, 1, 1, 1], [0, 1, 2, 3], [0, 1, 1, 2]]), delta=-1)
    assert mrope_positions(rope, 2, 6).tolist() == [[1, 1, 3, 4], [2, 3, 3, 4], [1, 2, 3, 4]]
    assert mrope_positions(None, 3, 5).tolist() == [[3, 4]] * 3



def test_benchmark_script_prints_ratios():
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "examples/bench_vlm.py", "--images", "4", "--repeats", "1",
                          "--vision-depth", "2", "--vision-hidden", "32"], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TTFT" in run.stdout and run.stdout.count("throughput") == 2
