"""Tool calling through a real server with the official openai client, on the tiny demo Llama (random weights; its
ChatML template renders no tools) and on the same model with a Hermes-style template that does.

* tool_choice required (one call, or several with parallel_tool_calls) and a named function always yield calls
  whose arguments validate against the function's schema, streamed and not; then a tool-result turn is answered.
* auto on a template without a tool format is refused naming `tools`; on a Hermes template it is served and the
  tools are rendered into the prompt.
* Bad tools, tool_choice and tool messages are refused naming the field.
* The Hermes and Llama 3 formats read calls out of text.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from pipelines.tool_formats import hermes, llama3

try:
    from tests.test_serve_support import Server
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
          "</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from pipelines.demo import build_demo_model

    plain = build_demo_model("llama", tmp_path_factory.mktemp("tools") / "llama")
    hermes_path = tmp_path_factory.mktemp("tools-hermes") / "llama"
    shutil.copytree(plain, hermes_path)
    config = json.loads((hermes_path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES
    (hermes_path / "tokenizer_config.json").write_text(json.dumps(config))
    (hermes_path / "chat_template.jinja").unlink(missing_ok=True)
    srv = Server(tmp_path_factory.mktemp("tools-server"), f"""
[[models]]
name = "plain"
path = "{plain}"
family = "causal-lm"
[[models]]
name = "hermes"
path = "{hermes_path}"
family = "causal-lm"
""")
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="not-needed", max_retries=0)
    finally:
        srv.stop()


def assert_valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(client, **kwargs) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_required_and_named_calls_always_parse(servers):
    client = servers
    for seed in range(3):
        reply = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=0.9, seed=seed, max_tokens=96)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid(choice.message.tool_calls)
    several = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                             temperature=0, max_tokens=160)
    assert_valid(several.choices[0].message.tool_calls)
    named = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, temperature=0, max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "PST")
    calls, finish = streamed_calls(client, model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_tokens=96)
    whole = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=96)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_a_tool_result_turn_is_answered(servers):
    client = servers
    first = client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=96)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    reply = client.chat.completions.create(model="plain", messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="plain", messages=[*ASK, {"role": "tool", "tool_call_id": "call_nope",
                                                                       "content": "{}"}], max_tokens=4)
    assert info.value.body["param"] == "messages[1].tool_call_id"


def test_auto_needs_a_template_that_speaks_a_tool_format(servers):
    client = servers
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="plain", messages=ASK, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "tools"
    with_tools = client.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, temperature=0, max_tokens=4)
    without = client.chat.completions.create(model="hermes", messages=ASK, temperature=0, max_tokens=4)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the tools were rendered
    choice = with_tools.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_fields_are_refused_naming_them(servers, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        servers.chat.completions.create(model="plain", messages=ASK, max_tokens=4, **extra)
    assert info.value.body["param"] == param, info.value.body


def test_formats_read_calls_out_of_text():
    names = {"get_weather", "get_time"}
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n' \
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    assert hermes.parse(text, names) == ("Let me look.", [("get_weather", {"city": "Paris", "days": 2}),
                                                          ("get_time", {"zone": "CET"})])
    assert hermes.parse("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>", names)[1] == []
    assert hermes.parse("no calls here", names) == ("no calls here", [])
    assert llama3.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', names) == (
        None, [("get_time", {"zone": "UTC"})])
    assert llama3.parse("It is sunny.", names) == ("It is sunny.", [])
