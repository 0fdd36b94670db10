"""A streamed spoken reply from Qwen2.5-Omni: token2wav decodes chunks of the talker's codes while the talker is
still speaking, and the vocoder's chunks go out as they are made.

The demo checkpoint here has a 1024-code codec (its random talker's end code is then rare, so replies run to the
`max_speech_codes` bound: several chunks). For one seed the streamed reply's text and codes are generate()'s; its
waveform equals transformers' token2wav on those codes with the stream's own noise (`torch.manual_seed(seed +
NOISE_STREAM)`), up to the chunking (3 DiT blocks of context: measured 7e-6, checked at 1e-4)."""

from __future__ import annotations

import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.chat_parts import VLMConfig
from pipelines.omni import NOISE_STREAM, SAMPLE_RATE, SpeechOutput
from stages.events import EventKind
from stages.llm.params import SamplingParams
from tests.helpers import assert_cancel_after_first_audio_ends_everywhere, running_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8)
MAX_CODES = 96  # 8 DiT blocks: chunks of 1, 2, 4, then the 1 left
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from pipelines.demo.omni import build_qwen2_5_omni

    out = tmp_path_factory.mktemp("omni") / "omni1024"
    build_qwen2_5_omni(0, codec_vocab=1024).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def engine(path):
    with running_engine(path, family="vlm", vlm=VLMConfig(max_speech_codes=MAX_CODES)) as eng:
        yield eng


def streamed_reference(model, processor, messages, seed: int, voice: str, max_tokens: int, max_codes: int):
    """(reply ids, generate()'s waveform, the streamed reply's reference waveform): generate() after
    torch.manual_seed(seed), its token2wav's codes caught on the way; then token2wav on those codes after
    torch.manual_seed(seed + NOISE_STREAM), where a streamed reply draws its noise."""
    from pipelines.demo.omni import TALKER_EOS

    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    caught = []
    token2wav = model.token2wav.forward

    def catch(code, *args, **kwargs):
        caught.append((code, kwargs))
        return token2wav(code, *args, **kwargs)

    model.token2wav.forward = catch
    try:
        torch.manual_seed(seed)
        with torch.inference_mode():
            ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=max_tokens,
                                      talker_eos_token_id=TALKER_EOS, talker_max_new_tokens=max_codes)
    finally:
        del model.token2wav.forward
    (code, kwargs), = caught
    torch.manual_seed((seed + NOISE_STREAM) % (1 << 64))
    with torch.inference_mode():
        streamed = token2wav(code, **kwargs).reshape(-1).float()
    return ids[0, inputs["input_ids"].shape[1]:].tolist(), wav, streamed


@pytest.fixture(scope="module")
def reference(path):
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    return lambda seed, voice="Chelsie": streamed_reference(model, processor, MESSAGES, seed, voice, GREEDY.max_tokens,
                                                            MAX_CODES)


def spoken(engine, seed: int, stream: bool, voice: str = "Chelsie"):
    return engine.submit_chat("m", ChatRequest(messages=MESSAGES, params=GREEDY,
                                               speech=SpeechOutput(voice, seed, stream=stream)))


def test_streamed_audio_comes_in_chunks_while_the_talker_speaks(engine, reference):
    """Chunks of audio go out before the talker's last code; they concatenate to the reply's waveform, which equals
    transformers' token2wav on generate()'s codes with the stream's noise; the whole (unstreamed) reply still
    equals generate()."""
    ids, whole, want = reference(4)
    handle = spoken(engine, 4, stream=True)
    chunks, codes, codes_at_first_window, final, thinker_at_talker = [], 0, None, None, None
    thinker = 0
    for event in handle.events(timeout=300):
        if event.kind is EventKind.DELTA and event.stage == "llm":
            thinker += 1
        elif event.kind is EventKind.STAGE_STARTED and event.stage == "talker":
            thinker_at_talker = thinker
        elif event.kind is EventKind.DELTA and event.stage == "talker":
            codes += len(event.data["codes"])
        elif event.kind is EventKind.STAGE_STARTED and event.stage == "token2wav":
            codes_at_first_window = codes
        elif event.kind is EventKind.DELTA and event.stage == "vocoder":
            chunks.append(event.data["audio"])
        elif event.kind is EventKind.FINAL:
            final = event.data["outputs"]
    assert final is not None and final["choices"][0]["token_ids"] == ids
    assert thinker == len(ids) == GREEDY.max_tokens and thinker_at_talker == 1  # the talker joined at the first token
    assert codes == MAX_CODES and len(chunks) == 4  # chunks of 1, 2, 4 and 1 blocks (96 codes: 8 blocks)
    # token2wav's first window went to its pool when the talker had drawn the chunk (12 codes) and its right
    # context (36), not at its end
    assert codes_at_first_window == 48
    audio = torch.cat(chunks)
    assert final["sample_rate"] == SAMPLE_RATE and torch.equal(final["audio"], audio)
    assert audio.shape == want.shape == whole.shape
    torch.testing.assert_close(audio, want, rtol=0, atol=1e-4)
    assert (audio - whole).abs().max() > 1e-2  # other noise: a streamed reply is not generate()'s waveform
    unstreamed = spoken(engine, 4, stream=False).result(timeout=300)
    torch.testing.assert_close(unstreamed["audio"], whole, rtol=0, atol=1e-5)


def test_streamed_replies_batch_their_chunks(engine, reference):
    """Three streamed replies at once (two voices): token2wav's windows of different replies share calls, and
    each reply equals its own reference."""
    LABELS = {"stage": "m/token2wav", "model": "m"}

    def batched() -> float:
        return engine.metrics.registry.get_sample_value("mmserve_stage_batch_size_sum", LABELS) or 0

    calls = engine.metrics.registry.get_sample_value("mmserve_stage_batch_size_count", LABELS) or 0
    before = batched()
    handles = [spoken(engine, 10 + i, stream=True, voice=("Chelsie", "Ethan")[i % 2]) for i in range(3)]
    results = [h.result(timeout=300) for h in handles]
    for i, result in enumerate(results):
        ids, _, want = reference(10 + i, ("Chelsie", "Ethan")[i % 2])
        assert result["choices"][0]["token_ids"] == ids
        torch.testing.assert_close(result["audio"], want, rtol=0, atol=1e-4)
    windows = batched() - before
    now = engine.metrics.registry.get_sample_value("mmserve_stage_batch_size_count", LABELS)
    assert windows == 12 and now - calls < 12  # 12 windows in fewer calls


def test_cancel_mid_stream_ends_the_request_everywhere(engine):
    """A cancel after the first audio chunk: the request ends with a cancelled error, no chunk follows it, and every
    stage lets go of it (the executor is idle: no window or vocoder piece left queued or running)."""
    assert_cancel_after_first_audio_ends_everywhere(engine, spoken(engine, 5, stream=True))
