"""Tracing, request ids and JSON request logs (stages/tracing.py, serve/tracing.py) over the tiny demo sd model,
through the real app in process."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from serve.app import create_app
from serve.config import ServerConfig
from serve.tracing import JsonFormatter
from stages.tracing import Tracing
from tests.helpers import demo_path, running_engine

IMAGE = {"model": "sd", "prompt": "a red bicycle", "size": "64x64", "num_inference_steps": 2, "seed": 1}
NODES = ("text_encode", "denoise", "vae_decode")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(demo_path(tmp_path_factory, "sd"), name="sd") as eng:
        yield eng


def _generate(engine, tmp_path, headers: dict[str, str] | None = None, **app_kwargs):
    with TestClient(create_app(engine, data_dir=tmp_path, **app_kwargs)) as client:
        return client.post("/v1/images/generations", json=IMAGE, headers=headers or {})


def test_an_image_request_has_a_request_span_and_one_child_span_per_stage(engine, tmp_path):
    tracing = Tracing.from_mode("memory")
    assert tracing is not None
    reply = _generate(engine, tmp_path, tracing=tracing)
    assert reply.status_code == 200, reply.text
    rid = reply.headers["x-request-id"]
    spans = tracing.exporter.get_finished_spans()
    [request] = [s for s in spans if s.parent is None]
    attrs = request.attributes
    assert (attrs["mmserve.route"], attrs["mmserve.status"], attrs["mmserve.model"]) == \
        ("/v1/images/generations", 200, "sd")
    assert (attrs["mmserve.request_id"], attrs["mmserve.tenant"]) == (rid, "default")
    children = {s.name: s for s in spans if s.parent is not None}
    assert set(NODES) <= set(children)
    for name in NODES:
        span = children[name]
        assert span.parent.span_id == request.context.span_id and span.context.trace_id == request.context.trace_id
        a = span.attributes
        assert a["mmserve.request_id"] == rid and a["mmserve.stage"] == f"sd/{name}"
        assert a["mmserve.batch_size"] >= 1 and a["mmserve.batch_id"].startswith(f"sd/{name}-")
        assert a["mmserve.queue_wait_s"] >= 0 and a["mmserve.run_time_s"] > 0
    assert children["denoise"].attributes["mmserve.calls"] == 2  # one stage call per step
    assert children["text_encode"].attributes["mmserve.calls"] == 1


def test_the_text_encode_span_says_whether_the_prompt_cache_hit(engine, tmp_path):
    """A prompt's first request computes its embeddings (a miss), the same prompt again finds them (a hit)."""
    tracing = Tracing.from_mode("memory")
    assert tracing is not None
    with TestClient(create_app(engine, data_dir=tmp_path, tracing=tracing)) as client:
        for _ in range(2):
            reply = client.post("/v1/images/generations", json={**IMAGE, "prompt": "a cache probe"})
            assert reply.status_code == 200, reply.text
    first, again = [s.attributes for s in tracing.exporter.get_finished_spans() if s.name == "text_encode"]
    assert first["mmserve.cache_hit"] is False and first["mmserve.cache_misses"] >= 1
    assert again["mmserve.cache_hit"] is True and again["mmserve.cache_misses"] == 0
    assert again["mmserve.cache_hits"] == first["mmserve.cache_hits"] + first["mmserve.cache_misses"]
    denoise = [s.attributes for s in tracing.exporter.get_finished_spans() if s.name == "denoise"]
    assert all("mmserve.cache_hit" not in a for a in denoise)  # it looks nothing up


def test_the_llm_span_counts_the_prefix_cached_tokens(tmp_path_factory, tmp_path):
    from pipelines.chat import LLMConfig

    tracing = Tracing.from_mode("memory")
    assert tracing is not None
    chat = {"model": "llama", "messages": [{"role": "user", "content": "tell me about the sea " * 4}], "max_tokens": 2}
    with running_engine(demo_path(tmp_path_factory, "llama"), name="llama", llm=LLMConfig(kv_cache_mb=8)) as llama, \
            TestClient(create_app(llama, data_dir=tmp_path, tracing=tracing)) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
    first, again = [s.attributes for s in tracing.exporter.get_finished_spans() if s.name == "llm"]
    assert first["mmserve.cached_tokens"] == 0 and again["mmserve.cached_tokens"] > 0


def test_tracing_off_exports_nothing(engine, tmp_path):
    tracing = Tracing.from_mode("memory")
    assert tracing is not None and Tracing.from_mode("off") is None
    assert _generate(engine, tmp_path, tracing=tracing).status_code == 200
    traced = len(tracing.exporter.get_finished_spans())
    # An app made without tracing over the same engine: neither the request nor its stages make spans.
    assert _generate(engine, tmp_path).status_code == 200
    assert engine.executor.tracing is None
    assert len(tracing.exporter.get_finished_spans()) == traced


def test_a_client_request_id_comes_back_and_is_the_engine_request_id(engine, tmp_path):
    tracing = Tracing.from_mode("memory")
    assert tracing is not None
    reply = _generate(engine, tmp_path, headers={"x-request-id": "client-42.a_b"}, tracing=tracing)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "client-42.a_b"
    stage_ids = {s.attributes["mmserve.request_id"] for s in tracing.exporter.get_finished_spans() if s.parent}
    assert stage_ids == {"client-42.a_b"}  # the engine request's id, on every node's span


@pytest.mark.parametrize("sent", ["has space", "x" * 129, "caf\u00e9"])
def test_a_bad_client_request_id_is_refused_naming_the_header(engine, tmp_path, sent):
    with TestClient(create_app(engine, data_dir=tmp_path)) as client:
        reply = client.post("/v1/images/generations", json=IMAGE, headers={"x-request-id": sent.encode("utf-8")})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "x-request-id"


def test_json_log_line_per_request(engine, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mmserve.requests"):
        reply = _generate(engine, tmp_path, log_format="json")
    assert reply.status_code == 200
    [record] = [r for r in caplog.records if r.name == "mmserve.requests"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == reply.headers["x-request-id"]
    assert (line["tenant"], line["model"], line["route"], line["status"]) == \
        ("default", "sd", "/v1/images/generations", 200)
    assert line["duration_ms"] > 0 and 0 <= line["queue_ms"] <= line["duration_ms"]


def test_text_logs_write_no_request_lines(engine, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mmserve.requests"):
        assert _generate(engine, tmp_path).status_code == 200
    assert not [r for r in caplog.records if r.name == "mmserve.requests"]


def test_config_names_the_bad_key():
    with pytest.raises(ValueError, match="server.tracing"):
        ServerConfig(tracing="jaeger")
    with pytest.raises(ValueError, match="server.log_format"):
        ServerConfig(log_format="xml")
