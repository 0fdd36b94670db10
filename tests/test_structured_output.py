"""Constrained decoding (`response_format`) on the tiny demo Llama (random weights: whatever it says is noise, yet
every constrained output must parse and validate).

* 50 random bounded JSON schemas (objects, arrays, enums, consts, nested objects, anyOf, $ref), sampled and greedy,
  all in flight at once with 8 free requests: every output parses and validates (jsonschema), and the free rows
  are their solo replies.
* Greedy constrained output equals transformers' generate() with xgrammar's own logits processor (plus the ban of
  control-character tokens in JSON rows that mmserve adds: stages/llm/grammar.py), for a schema, a regex and an
  EBNF grammar.
* Through a real server with the official openai client: json_schema (streamed and not), json_object, and the
  refusals, each naming its field.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.image_request import RequestError
from stages.llm.grammar import Grammar
from stages.llm.params import SamplingParams
from tests.helpers import running_engine

try:
    from tests.test_serve_support import Server
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server

HELLO = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("llama", tmp_path_factory.mktemp("structured") / "llama"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    with running_engine(checkpoint, family="causal-lm") as eng:
        yield eng


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded JSON Schema: every string, array and integer has a bound, so any output ends in few tokens."""
    kinds = ["string", "integer", "boolean", "enum", "const", "null", "array"] + (["object", "anyOf"] if depth < 2
                                                                                  else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, False])}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = rng.sample(["name", "age", "city", "tags", "ok", "meta", "id"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def schemas(count: int) -> list[dict]:
    rng = random.Random(20)
    out = []
    for i in range(count):
        schema = random_schema(rng, depth=1) if i % 5 else {"type": "array", "items": random_schema(rng, 1),
                                                            "maxItems": 3}
        if i % 7 == 0:  # a root object with a $ref into $defs
            schema = {"type": "object", "$defs": {"item": schema}, "properties": {"item": {"$ref": "#/$defs/item"}},
                      "required": ["item"], "additionalProperties": False}
        out.append(schema)
    return out


def test_random_schemas_always_parse_and_validate_alongside_free_requests(engine):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = [engine.submit_chat("m", ChatRequest(messages=[{"role": "user", "content": f"free {i}"}], params=free))
            .result(timeout=120)["choices"][0]["token_ids"] for i in range(8)]
    handles = []
    for i, schema in enumerate(schemas(50)):
        params = SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=256,
                                response_format=Grammar("json_schema", json.dumps(schema)))
        handles.append((schema, engine.submit_chat("m", ChatRequest(messages=HELLO, params=params))))
    frees = [engine.submit_chat("m", ChatRequest(messages=[{"role": "user", "content": f"free {i}"}], params=free))
             for i in range(8)]
    for schema, handle in handles:
        choice = handle.result(timeout=300)["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice["text"])
        jsonschema.validate(json.loads(choice["text"]), schema)
        assert " " not in choice["text"].replace('" ', "").split('"')[0]  # compact: no whitespace outside strings
    assert [h.result(timeout=300)["choices"][0]["token_ids"] for h in frees] == solo
    assert engine.metrics.stage.max_batch_size("m/llm", "m") > 8  # constrained and free rows shared steps


def reference(checkpoint: str, grammar: Grammar, max_tokens: int) -> list[int]:
    """transformers' greedy generate() under xgrammar's own logits processor (and, for JSON, the same ban of
    control-character tokens): the reply's token ids."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    from stages.llm.grammar import Grammars

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    eos = [model.generation_config.eos_token_id, tokenizer.eos_token_id]
    grammars = Grammars(tokenizer, model.get_output_embeddings().weight.shape[0], sorted({e for e in eos if e is not
                                                                                         None}))

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, grammars.control_tokens] = -torch.inf
            return scores

    processors = [xgr.contrib.hf.LogitsProcessor(grammars.compile(grammar))]
    if grammar.kind.startswith("json"):
        processors.append(Ban())
    ids = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList(processors))
    return out[0, ids["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("grammar", [
    Grammar("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                                        "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
                                       "required": ["name", "n"], "additionalProperties": False})),
    Grammar("regex", "(yes|no|maybe), [0-9]{2,4}!"),
    Grammar("grammar", 'root ::= "<" word ("," word)* ">"\nword ::= [a-z]+'),
], ids=["json_schema", "regex", "ebnf"])
def test_greedy_constrained_output_equals_generate_with_xgrammar(engine, checkpoint, grammar):
    params = SamplingParams(temperature=0, max_tokens=40, response_format=grammar)
    ours = engine.submit_chat("m", ChatRequest(messages=HELLO, params=params)).result(timeout=120)["choices"][0]
    theirs = reference(checkpoint, grammar, 40)
    assert ours["token_ids"] == theirs
    if grammar.kind == "json_schema":
        assert ours["finish_reason"] == "stop" and set(json.loads(ours["text"])) == {"name", "n"}


def test_n_choices_each_keep_the_grammar(engine):
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=64,
                            response_format=Grammar("regex", "[A-C]{1,3}-[0-9]"))
    choices = engine.submit_chat("m", ChatRequest(messages=HELLO, params=params)).result(timeout=120)["choices"]
    assert len(choices) == 3
    for choice in choices:
        text = choice["text"]
        assert choice["finish_reason"] == "stop" and 3 <= len(text) <= 5 and text[-2] == "-" and text[-1].isdigit()


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {"type": "object"}}}},
     "response_format.json_schema.schema", "'if'"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format", "cannot be compiled"),
    ({"type": "grammar", "grammar": "root ::= undefined_rule"}, "response_format", "cannot be compiled"),
    ({"type": "xml"}, "response_format.type", "json_schema"),
    ({"type": "json_object", "schema": {}}, "response_format", "unknown field"),
])
def test_bad_response_formats_are_refused_naming_the_field(engine, response_format, param, words):
    from serve.schemas_chat import ChatCompletionRequest

    with pytest.raises(RequestError) as info:
        body = ChatCompletionRequest(messages=HELLO, response_format=response_format)
        engine.submit_chat("m", ChatRequest(messages=HELLO, params=body.sampling_params()))
    assert info.value.param == param and words in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def client(tmp_path_factory, checkpoint):
    srv = Server(tmp_path_factory.mktemp("structured-server"), f"""
[[models]]
name = "llama-demo"
path = "{checkpoint}"
family = "causal-lm"
""")
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="not-needed", max_retries=0)
    finally:
        srv.stop()


def test_structured_output_through_the_openai_client(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model="llama-demo", messages=HELLO, temperature=0, max_tokens=64,
                                           response_format=response_format)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="llama-demo", messages=HELLO, temperature=0, max_tokens=64,
                                            response_format=response_format, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    anything = client.chat.completions.create(model="llama-demo", messages=HELLO, temperature=0, max_tokens=64,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama-demo", messages=HELLO, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}})
    assert info.value.body["param"] == "response_format.json_schema.schema" and "'not'" in info.value.body["message"]
