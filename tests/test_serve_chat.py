"""/v1/chat/completions and /v1/completions through a real server process, driven by the official openai client.

One module-scoped server on the tiny demo Llama (random weights: the text is noise, the code path is real);
greedy requests of a few tokens keep the module fast.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
import torch

try:
    from tests.test_serve_support import Server, metric, wait_for
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric, wait_for

MODEL = "llama-demo"
HELLO = [{"role": "user", "content": "hello, how are you?"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})  # ignore_eos: the random model never stops early
BLOCK_SIZE = 4  # KV block of the test server: prefix-cache hits come in whole blocks
MAX_BODY_BYTES = 4 * 2**20  # [server] max_body_bytes of the test server
TOKENIZED = "mmserve_llm_tokenized_characters_total"  # prompt characters the server ran through the tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return build_demo_model("llama", tmp_path_factory.mktemp("serve-chat-model") / "llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    workdir = tmp_path_factory.mktemp("serve-chat")
    srv = Server(workdir, f"""
[server]
max_body_bytes = {MAX_BODY_BYTES}
[[models]]
name = "{MODEL}"
path = "{checkpoint}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
block_size = {BLOCK_SIZE}
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


def cached_in_full_blocks(prompt_tokens: int) -> int:
    """Prompt tokens a repeat of a cached prompt reuses: its whole blocks, short of the last token (whose
    logits must be computed)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


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
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == cached_in_full_blocks(usage.prompt_tokens) > 0
    assert again.choices[0].message.content == choice.message.content


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


PROMPTS = ["The quick brown fox", [5, 6, 7, 8, 9], "hello, how are you?", [11, 12, 13]]  # text and token ids


def test_completions_list_of_prompts(client, checkpoint):
    """One choice per prompt and n, indexed prompt * n + j; each equals the prompt sent alone, and generate()."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=6, **GREEDY)
    assert [c.index for c in reply.choices] == list(range(2 * len(PROMPTS)))
    model, tok = AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)
    prompt_tokens = 0
    for k, prompt in enumerate(PROMPTS):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
        ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        generated = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(ids):]
        assert tok.decode(generated) == alone.choices[0].text
        assert [c.text for c in reply.choices[2 * k:2 * k + 2]] == [alone.choices[0].text] * 2, f"prompt {k}"
        assert all(c.finish_reason == "length" for c in reply.choices[2 * k:2 * k + 2])
        prompt_tokens += alone.usage.prompt_tokens
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 2 * len(PROMPTS) * 6
    # streamed: every chunk names its choice; per index the same text as the JSON reply
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in reply.choices}
    assert finish == {c.index: "length" for c in reply.choices}
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_completions_list_with_a_bad_prompt_names_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["fine", [1, 10**6]], max_tokens=2)
    assert info.value.body["param"] == "prompt[1]" and "token ids must be in [0, " in info.value.body["message"]


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
    assert again.usage.prompt_tokens_details.cached_tokens == cached_in_full_blocks(first.usage.prompt_tokens)
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
    ({"prompt": list(range(3000))}, "prompt"),  # longer than the context
    ({"prompt": ["a", 5]}, "prompt[1]"),  # a list of prompts holds strings and token-id lists
    ({"prompt": [1, "a"]}, "prompt[1]"),  # a token-id prompt holds integers
    ({"prompt": ["a", [1, 10**6]]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),  # empty
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": ["a", [2.5]]}, "prompt[1]"),
    ({"prompt": ["a", "hi " * 3000]}, "prompt[1]"),  # longer than the context
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices: more than 128
    ({"prompt": 5}, "prompt"),
    ({"logprobs": 50}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"messages": HELLO}, "messages"),  # a chat field
])
def test_bad_completion_input_names_the_field(server, fields, param):
    assert_error(post(server, "/v1/completions", **{"prompt": "hi", **fields}), 400, param)


def test_logprobs_error_names_logprobs_and_its_limit(server):
    error = assert_error(post(server, "/v1/completions", prompt="hi", logprobs=100), 400, "logprobs")
    assert error["message"].startswith("logprobs must be in [0, 20]") and "top_logprobs" not in error["message"]
    error = assert_error(post(server, "/v1/chat/completions", messages=HELLO, max_completion_tokens=0), 400,
                         "max_completion_tokens")
    assert error["message"].startswith("max_completion_tokens must be >= 1")


def test_error_codes(server):
    too_long = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi " * 3000}])
    assert_error(too_long, 400, "messages", "context_length_exceeded")
    assert_error(post(server, "/v1/completions", prompt=["a", "hi " * 3000]), 400, "prompt[1]",
                 "context_length_exceeded")
    assert_error(post(server, "/v1/chat/completions", messages=HELLO, bogus=1), 400, "bogus", "unknown_parameter")
    assert_error(post(server, "/v1/chat/completions", model="nope", messages=HELLO), 404, "model", "model_not_found")
    ok = post(server, "/v1/chat/completions", messages=HELLO, top_k=-1, max_tokens=1)  # -1: top_k off
    assert ok.status_code == 200, ok.text


# -- request size ---------------------------------------------------------------------------


def tokenized(server) -> float:
    return metric(server.url, TOKENIZED, model=MODEL)


def test_body_over_the_limit_is_refused_unread(server):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()
    before = tokenized(server)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    error = assert_error(r, 413, None, "request_too_large")
    assert f"{len(big)} bytes" in error["message"] and str(MAX_BODY_BYTES) in error["message"]
    # chunked (no Content-Length): counted as it arrives
    chunked = httpx.post(f"{server.url}/v1/chat/completions", content=iter([big[i:i + 2**20]
                                                                             for i in range(0, len(big), 2**20)]),
                         headers={"content-type": "application/json"}, timeout=60)
    error = assert_error(chunked, 413, None, "request_too_large")
    assert f"more than {MAX_BODY_BYTES} bytes" in error["message"]
    assert tokenized(server) == before
    # the limit is applied to the header alone: the answer comes before a byte of the body is sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {10 * 2**20}\r\n\r\n".encode())
        reply = b""
        while b"}}" not in reply:  # the error object, whole
            data = s.recv(65536)
            assert data, reply
            reply += data
    assert reply.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in reply
    # a body of exactly the limit is read (and answered on its merits)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": ""}
    body["user"] = "u" * (MAX_BODY_BYTES - len(json.dumps(body)))
    assert len(json.dumps(body)) == MAX_BODY_BYTES
    ok = httpx.post(f"{server.url}/v1/completions", content=json.dumps(body),
                    headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_prompt_far_over_the_context_is_refused_untokenized(server):
    """Characters alone prove it cannot fit: context_length_exceeded before the tokenizer sees it."""
    before = tokenized(server)
    huge = "x" * 2_000_000  # under the byte limit, a thousand times the context in characters
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": huge}])
    assert "characters" in assert_error(chat, 400, "messages", "context_length_exceeded")["message"]
    assert_error(post(server, "/v1/completions", prompt=huge), 400, "prompt", "context_length_exceeded")
    assert_error(post(server, "/v1/completions", prompt=["a", huge]), 400, "prompt[1]", "context_length_exceeded")
    assert tokenized(server) == before
    # the counter counts: a prompt a little over the context is tokenized, then refused on its token count
    assert_error(post(server, "/v1/completions", prompt="hi " * 3000), 400, "prompt", "context_length_exceeded")
    assert tokenized(server) == before + len("hi " * 3000)


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
