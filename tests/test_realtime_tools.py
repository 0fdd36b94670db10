"""Function calling in realtime voice sessions, in process (no socket), on the tiny voice cascade whose chat model is
the random demo Llama (its ChatML template renders no tool calls, so tool_choice required: the call is grammar-
constrained and always parses).

* A session with tools answers with a function_call item (its events in order, arguments valid against the schema,
  no audio); the client sends the function_call_output and a new response, which speaks, its prompt holding the call
  and the result.
* Bad tools, tool_choice and call ids are refused naming the field, and change nothing; the fence still holds.
* With tool_choice auto the splitter speaks a reply only once it is known not to be a call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types

import jsonschema
import pytest

from pipelines.chat import ChatRequest
from pipelines.tool_formats import hermes
from pipelines.tools import Tools
from pipelines.tts import SpeechRequest
from pipelines.voice_turn import PhraseSpeech, turn_graph
from tests.test_realtime_voice_session import audio_ms, open_session, sdk_check, send, user_text
from tests.test_realtime_voice_support import voice_engine, voice_models

__all__ = ["voice_models"]  # the fixture, imported for pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MANUAL = {"audio": {"input": {"turn_detection": None}}}  # the client drives turns


@pytest.fixture(scope="module")
def engine(voice_models):
    eng = voice_engine(voice_models, max_output_tokens=96)  # room for the call's JSON
    yield eng
    eng.shutdown()


def test_a_call_its_output_and_the_spoken_answer(engine):
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"type": "realtime", **MANUAL, "tools": TOOLS,
                                                             "tool_choice": "required",
                                                             "parallel_tool_calls": False}})
        updated = await c.wait_event("session.updated")
        await send(s, user_text("What is the weather in Paris?"))
        await send(s, {"type": "response.create"})
        first = await c.wait_event("response.done")
        call = first["response"]["output"][0]
        mark = len(c.events)
        await send(s, {"type": "conversation.item.truncate", "item_id": call["id"], "content_index": 0,
                       "audio_end_ms": 0})  # a call has no audio
        await send(s, {"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"], "output": json.dumps({"temperature": 21})}})
        created = await c.wait_event("conversation.item.created", 2)
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        await send(s, {"type": "response.create", "response": {"tool_choice": "none", "max_output_tokens": 8}})
        second = await c.wait_event("response.done", 2)
        await s.close("test")
        return c, updated, first, c.events[mark:], created, context, second

    c, updated, first, after, created, context, second = asyncio.run(main())
    assert updated["session"]["tools"] == [{**TOOLS[0]}, {**TOOLS[1], "description": ""}]
    assert updated["session"]["tool_choice"] == "required"
    # the first response: one function call, its events in the realtime API's order, nothing spoken
    r1 = first["response"]["id"]
    turn = [e for e in c.events if e.get("response_id") == r1 or e.get("response", {}).get("id") == r1
            or e.get("item", {}).get("type") == "function_call"]
    assert [e["type"] for e in turn] == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "conversation.item.done", "response.done", "response.metrics"]
    added, delta, done = turn[1]["item"], turn[3], turn[4]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["arguments"] == ""
    assert first["response"]["status"] == "completed" and len(first["response"]["output"]) == 1
    call = first["response"]["output"][0]
    assert call["type"] == "function_call" and call["status"] == "completed" and call["call_id"].startswith("call_")
    assert delta["call_id"] == done["call_id"] == call["call_id"] and delta["item_id"] == call["id"]
    assert delta["delta"] == done["arguments"] == call["arguments"] and done["name"] == call["name"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert not c.of("response.output_audio.delta", response_id=r1)
    assert not c.of("response.output_audio_transcript.delta", response_id=r1)
    # the call has no audio to truncate; the output answers it
    error = next(e for e in after if e["type"] == "error")
    assert error["error"]["param"] == "item_id"
    assert created["item"] == {"id": created["item"]["id"], "object": "realtime.item", "type": "function_call_output",
                               "status": "completed", "call_id": call["call_id"], "output": '{"temperature": 21}'}
    # the next prompt holds the call (as tool_calls) and its result (a tool message)
    assert [m["role"] for m in context] == ["system", "user", "assistant", "tool"]
    assert context[2]["tool_calls"] == [{"id": call["call_id"], "type": "function",
                                         "function": {"name": call["name"], "arguments": call["arguments"]}}]
    assert context[3] == {"role": "tool", "tool_call_id": call["call_id"], "content": '{"temperature": 21}'}
    chat = engine.chat_model("llama-demo")
    prompt = chat.generation_request(ChatRequest(messages=context)).prompt_ids
    assert '{"temperature": 21}' in chat.tokenizer.decode(prompt)
    # ... and the answer is spoken from that prompt
    r2 = second["response"]
    assert r2["status"] in ("completed", "incomplete") and r2["usage"]["input_tokens"] == len(prompt)
    assert [o["type"] for o in r2["output"]] == ["message"]
    assert audio_ms(c.of("response.output_audio.delta", response_id=r2["id"])) > 0
    assert not c.of("response.function_call_arguments.done", response_id=r2["id"])
    sdk_check(c.events)


def test_bad_tools_and_unknown_call_ids_are_refused_naming_the_field(engine):
    good = {"type": "realtime", **MANUAL, "tools": TOOLS, "tool_choice": "required"}
    bad_updates = [
        ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"}, "session.tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strnig"}}], "tool_choice": "required"},
         "session.tools[0].parameters"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools[0]"),
        ({"tools": [{"type": "function", "name": "f", "colour": 1}], "tool_choice": "required"},
         "session.tools[0].colour"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "session.tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "session.tool_choice"),
        ({"tools": TOOLS}, "session.tools"),  # auto: this template's calls cannot be read back
        ({"tool_choice": "required"}, "session.tool_choice"),  # no tools to call
    ]

    async def main():
        s, c = await open_session(engine)
        for update, _ in bad_updates:
            await send(s, {"type": "session.update", "event_id": "ev_bad", "session": update})
        await c.wait_event("error", len(bad_updates))
        unchanged = (s.config.tools, len(c.of("session.updated")))
        await send(s, {"type": "session.update", "session": good})
        await c.wait_event("session.updated")
        await send(s, {"type": "response.create", "response": {"tools": [{"type": "function", "name": ""}]}})
        await send(s, {"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "call_nope", "output": "{}"}})
        await c.wait_event("error", len(bad_updates) + 2)
        items = len(s.conversation)
        await s.close("test")
        return c, unchanged, items

    c, unchanged, items = asyncio.run(main())
    errors = c.of("error")
    assert [e["error"]["param"] for e in errors] == [param for _, param in bad_updates] + [
        "response.tools[0].name", "item.call_id"]
    assert all(e["error"]["type"] == "invalid_request_error" and e["error"]["message"] for e in errors)
    assert errors[0]["error"]["event_id"] == "ev_bad"
    assert unchanged == (None, 0) and items == 0 and not c.of("response.created")


def test_the_fence_cancels_a_pending_call_and_a_named_call_follows(engine):
    """response.cancel while the call is being written: cancelled, no call item; the next response (a named
    function, set for that response only) makes its call in the new epoch."""
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"type": "realtime", **MANUAL, "tools": TOOLS,
                                                             "tool_choice": "required"}})
        await send(s, user_text("What time is it?"))
        await send(s, {"type": "response.create"})
        await send(s, {"type": "response.cancel"})
        cancelled = await c.wait_event("response.done")
        await send(s, {"type": "response.create", "response": {
            "tool_choice": {"type": "function", "name": "get_time"}}})
        named = await c.wait_event("response.done", 2)
        tools = s.config.tools
        await s.close("test")
        return c, cancelled, named, tools

    c, cancelled, named, tools = asyncio.run(main())
    assert cancelled["response"]["status"] == "cancelled" and cancelled["response"]["output"] == []
    assert cancelled["response"]["status_details"]["reason"] == "client_cancelled"
    assert len(c.of("response.function_call_arguments.done")) == 1
    (call,) = named["response"]["output"]
    assert named["response"]["epoch"] == 1 and call["name"] == "get_time"
    assert json.loads(call["arguments"])["zone"] in ("UTC", "CET", "PST")
    assert tools is not None and tools.choice == "required"  # the response's tool_choice was its own
    assert not c.of("response.output_audio.delta")
    sdk_check(c.events)


def test_auto_speaks_a_reply_only_once_it_is_known_not_to_be_a_call(engine):
    """tool_choice auto (a Hermes template): the llm ⇢ tts splitter holds the text; a call is never spoken, a plain
    reply is, whole; the turn's outputs carry the calls read from the text."""
    tools = Tools.parse([{"type": "function", "function": {"name": "get_time", "parameters": TIME}}], "auto", None)
    assert tools is not None
    model, speech = engine.speech_model("vits-demo"), SpeechRequest("", voice=engine.models["vits-demo"].voices[0])
    graph = turn_graph("llama-demo", "vits-demo", speech, model, tools=tools, form=hermes)
    tts = next(node for node in graph.nodes if node.name == "tts")
    assert tts.stream is not None

    def spoken(deltas: list[str]) -> list[str]:
        split = tts.stream.split()
        assert isinstance(split, PhraseSpeech)
        pieces = [p for d in deltas for p in split.feed({"text": d})]
        assert pieces == []  # nothing before the reply is whole
        return [p["text"] for p in split.flush({})]

    call = ["Let me look. <tool_call>", '{"name": "get_time", "arguments": {"zone": "UTC"}}', "</tool_call>"]
    assert spoken(call) == []
    said = spoken(["It is noon ", "in Paris. Enjoy ", "the sun."])
    assert " ".join(" ".join(said).split()) == "It is noon in Paris. Enjoy the sun."
    outputs = graph.finish({"pieces": [], "llm": {"choices": [{"index": 0, "text": "".join(call),
                                                               "finish_reason": "stop"}]}})
    choice = outputs["llm"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["content"] == "Let me look."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["tool_calls"]] == [
        ("get_time", '{"zone":"UTC"}')]
    forced = turn_graph("llama-demo", "vits-demo", speech, model, tools=dataclasses.replace(tools, choice="required"))
    assert [node.name for node in forced.nodes] == ["llm"]  # a forced call is never spoken: no tts node


@pytest.fixture(scope="module")
def server(voice_models, tmp_path_factory):
    from tests.test_realtime_voice_support import voice_server_config
    from tests.test_serve_support import Server

    srv = Server(tmp_path_factory.mktemp("tools-voice-server"), voice_server_config(voice_models, max_output_tokens=96))
    yield srv
    srv.stop()


def test_the_openai_sdk_calls_a_tool_and_hears_the_answer(server):
    """WS /v1/realtime with the official SDK's realtime client: a call, its output, then a text answer."""
    import openai
    from openai.types.realtime import ResponseDoneEvent, ResponseFunctionCallArgumentsDoneEvent

    async def turn(conn) -> list:
        seen = []
        async for event in conn:
            seen.append(event)
            if event.type == "response.done":
                return seen
        raise AssertionError("the socket closed")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="voice-demo") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "tools": TOOLS, "tool_choice": "required"})  # type: ignore[typeddict-item]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Time in Oslo?"}]})
            await conn.response.create()
            first = await turn(conn)
            args = next(e for e in first if isinstance(e, ResponseFunctionCallArgumentsDoneEvent))
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": args.call_id,
                                                      "output": '{"time": "12:00"}'})
            await conn.response.create(response={"tool_choice": "none", "max_output_tokens": 8})
            second = await turn(conn)
        return first, args, second

    first, args, second = asyncio.run(asyncio.wait_for(main(), 180))
    assert not [e for e in first if e.type == "error"]
    jsonschema.validate(json.loads(args.arguments), SCHEMAS[args.name])
    done = first[-1]
    assert isinstance(done, ResponseDoneEvent) and done.response.output is not None
    assert [(o.type, getattr(o, "call_id", None)) for o in done.response.output] == [("function_call", args.call_id)]
    assert not [e for e in second if e.type == "error"]
    answer = second[-1]
    assert isinstance(answer, ResponseDoneEvent) and answer.response.output is not None
    assert [o.type for o in answer.response.output] == ["message"]
    assert [e for e in second if e.type == "response.output_text.delta"]
