"""/v1/chat/completions and /v1/completions through a real server process, driven by the official openai client.

One module-scoped server on the tiny demo Llama (random weights: the text is noise, the code path is real);
greedy requests of a few tokens keep the module fast.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

try:
    from tests.test_serve_support import Server, metric, wait_for
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric, wait_for

MODEL = "llama-demo"
HELLO = [{"role": "user", "content": "hello, how are you?"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})  # ignore_eos: the random model never stops early


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipelines.demo import build_demo_model

    workdir = tmp_path_factory.mktemp("serve-chat")
    path = build_demo_model("llama", workdir / "llama")
    srv = Server(workdir, f"""
[[models]]
name = "{MODEL}"
path = "{path}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
block_size = 4
""")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def chat_stream(client, **kwargs) -> tuple[list, dict[int, str], dict[int, str], object]:
    """Chunks, text per choice, finish reason per choice, usage (from the last chunk)."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return chunks, texts, finish, chunks[-1].usage


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30)


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    return error


# -- the openai client ----------------------------------------------------------------------


def test_models_list_has_the_chat_model(client):
    entry = {m.id: m for m in client.models.list()}[MODEL].model_dump()
    assert entry["tasks"] == ["chat"] and entry["family"] == "causal-lm"


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, **GREEDY)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == MODEL
    [choice] = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    usage = reply.usage
    assert usage.completion_tokens == 5 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_agrees_with_json(client):
    request = dict(messages=HELLO, max_completion_tokens=7, n=2, **GREEDY)
    whole = client.chat.completions.create(model=MODEL, **request)
    chunks, texts, finish, usage = chat_stream(client, **request)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    openings = [c.choices[0] for c in chunks[:2]]  # one role chunk per choice, first
    assert [(o.index, o.delta.role) for o in openings] == [(0, "assistant"), (1, "assistant")]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert finish[choice.index] == choice.finish_reason == "length"
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 14
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy: n copies


def test_stream_ends_with_done(server):
    body = {"messages": HELLO, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_completions(client):
    reply = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, **GREEDY)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 4
    streamed = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed[:-1]) == choice.text
    assert streamed[-2].choices[0].finish_reason == "length"
    assert streamed[-1].usage.completion_tokens == 4 and streamed[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_completions_token_id_prompt(client):
    reply = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, **GREEDY)
    assert reply.usage.prompt_tokens == 4 and reply.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(client):
    request = dict(messages=HELLO, max_tokens=6, temperature=1.0, top_p=0.9, seed=7, n=2,
                   extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = client.chat.completions.create(model=MODEL, **request)
    b = client.chat.completions.create(model=MODEL, **request)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=3,
                                           **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == tops[0]  # greedy picks the top one
    raw = b"".join(bytes(entry.bytes) for entry in content)
    assert raw.decode("utf-8", errors="replace") == reply.choices[0].message.content
    # streamed: the same entries, spread over the chunks
    chunks, _, _, _ = chat_stream(client, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4, logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_string(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, **GREEDY).choices[0]
    text = full.message.content
    start = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, stop=[stop, "never"], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    _, texts, finish, _ = chat_stream(client, messages=HELLO, max_tokens=12, stop=stop, **GREEDY)
    assert (texts[0], finish[0]) == (cut.choices[0].message.content, "stop")


def test_repeated_long_prompt_hits_the_prefix_cache(client):
    messages = [{"role": "system", "content": "You serve requests. " * 8}, {"role": "user", "content": "Numbers?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens > 32
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content


# -- bad input ------------------------------------------------------------------------------


def test_bad_field_raises_in_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),  # -1 is "off"; 0 is refused
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
    ({"logit_bias": {"100000": 5}}, "logit_bias"),  # beyond the vocabulary
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"messages": [*HELLO, {"role": "wizard", "content": "hi"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hello " * 3000}]}, "messages"),  # longer than the context
    ({"bogus": 1}, "bogus"),
])
def test_bad_chat_input_names_the_field(server, fields, param):
    assert_error(post(server, "/v1/chat/completions", **{"messages": HELLO, **fields}), 400, param)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),  # a token id beyond the vocabulary
    ({"prompt": ["a", "b"]}, "prompt"),  # one prompt per request
    ({"prompt": list(range(3000))}, "prompt"),  # longer than the context
    ({"logprobs": 50}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"messages": HELLO}, "messages"),  # a chat field
])
def test_bad_completion_input_names_the_field(server, fields, param):
    assert_error(post(server, "/v1/completions", **{"prompt": "hi", **fields}), 400, param)


def test_error_codes(server):
    too_long = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi " * 3000}])
    assert_error(too_long, 400, "messages", "context_length_exceeded")
    assert_error(post(server, "/v1/chat/completions", messages=HELLO, bogus=1), 400, "bogus", "unknown_parameter")
    assert_error(post(server, "/v1/chat/completions", model="nope", messages=HELLO), 404, "model", "model_not_found")
    ok = post(server, "/v1/chat/completions", messages=HELLO, top_k=-1, max_tokens=1)  # -1: top_k off
    assert ok.status_code == 200, ok.text


# -- cancellation ---------------------------------------------------------------------------


def test_disconnect_mid_stream_cancels(server, client):
    def cancelled() -> float:
        return metric(server.url, "mmserve_graph_requests_total", model=MODEL, outcome="cancelled")

    before = cancelled()
    tokens_before = metric(server.url, "mmserve_llm_generated_tokens_total", model=MODEL)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        for _ in range(4):  # the role chunk, then tokens
            next(lines)
    assert wait_for(lambda: cancelled() == before + 1, timeout_s=60), server.log_tail()
    # the llm pool lets go of it at the next step boundary
    idle = lambda: metric(server.url, "mmserve_stage_active_items", stage=f"{MODEL}/llm") == 0  # noqa: E731
    assert wait_for(idle, timeout_s=60)
    tokens = metric(server.url, "mmserve_llm_generated_tokens_total", model=MODEL)
    assert tokens - tokens_before < 1000  # it stopped long before max_tokens
    time.sleep(0.2)
    assert metric(server.url, "mmserve_llm_generated_tokens_total", model=MODEL) == tokens  # and stays stopped
    # the server keeps serving
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
