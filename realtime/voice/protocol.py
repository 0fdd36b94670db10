"""The OpenAI Realtime wire protocol of voice sessions: client events in, session configuration in its GA
and beta shapes, and the names of server events in either dialect.

GA names are emitted by default. A session speaks the beta dialect (`response.audio.delta`,
`response.text.delta`, beta session objects and content types) when the client connected with
`OpenAI-Beta: realtime=v1` or its first `session.update` has the beta shape (top-level
`modalities`, `input_audio_format`, `turn_detection`, ... and no `type`). Both shapes are
accepted in `session.update` and `response.create` either way.

Every problem with a client event raises ProtocolError(code, message, param): the session answers
with an `error` event naming it (and the client's `event_id`) and carries on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pipelines.image_request import RequestError
from pipelines.tools import Tools
from realtime.sessions import ProtocolError  # noqa: F401  (raised here; importers take it from this module too)
from realtime.voice.audio_codec import FORMATS, GA_FORMATS, PCM16, AudioFormat
from realtime.voice.fields import check_number, check_optional_text, check_text
from realtime.voice.turn_detection import TurnDetection, parse_turn_detection

CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.truncate", "conversation.item.delete",
    "conversation.item.retrieve", "response.create", "response.cancel", "output_audio_buffer.clear",
    # extensions (notes/realtime.md §4.1): stock clients never send them
    "session.resume", "session.heartbeat", "session.event_ack", "playback.ack",
})
MAX_INSTRUCTIONS_CHARS = 32_768
MAX_TEXT_CHARS = 32_768  # one text content part of an item
BETA_SESSION_KEYS = frozenset({"modalities", "input_audio_format", "output_audio_format", "turn_detection", "voice",
                               "input_audio_transcription", "max_response_output_tokens",
                               "input_audio_noise_reduction", "speed", "client_secret"})
GA_SESSION_KEYS = frozenset({"type", "audio", "output_modalities", "max_output_tokens"})
IGNORED_SESSION_KEYS = frozenset({"tracing", "include", "truncation", "prompt", "temperature",
                                  "noise_reduction", "input_audio_noise_reduction", "client_secret", "expires_at",
                                  "id", "object", "reasoning"})
TOOL_KEYS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
# The tool choices a cascade's chat model serves when its template has no tool format: `auto` cannot be read back.
FORCED_CHOICES = frozenset({"none", "required", "function"})
BETA_NAMES = {  # GA name -> beta name (the rest are the same in both)
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
}
BETA_CONTENT = {"output_audio": "audio", "output_text": "text"}


@dataclass(frozen=True)
class SessionConfig:
    """A session's effective configuration (what `session.updated` reports)."""

    voice: str  # a voice of the TTS model
    instructions: str
    max_output_tokens: int  # the voice model's cap unless the client asked for fewer
    output_modalities: tuple[str, ...] = ("audio",)  # ("audio",) (with a transcript) or ("text",)
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    turn_detection: TurnDetection | None = TurnDetection()
    temperature: float = 0.8
    speed: float = 1.0
    transcription_language: str | None = None  # hints for the ASR model
    transcription_prompt: str | None = None
    beta: bool = False  # emit beta event names and shapes
    tools: Tools | None = None  # the functions the model may call (pipelines/tools.py); None: no tools
    tool_choice: Any = "auto"  # as the client set it (realtime's shape): kept apart, it applies once tools come


@dataclass(frozen=True)
class ResponseParams:
    """What one `response.create` asks for, merged over the session's configuration."""

    output_modalities: tuple[str, ...]
    instructions: str
    max_output_tokens: int
    temperature: float
    conversation: str = "auto"  # "none": the response is not added to the conversation
    metadata: dict[str, str] | None = None
    input_items: tuple[dict[str, Any], ...] | None = None  # conversation "none": the context to answer instead
    tools: Tools | None = None  # the session's tools, or the response's own; None: no tools

    @property
    def calls(self) -> bool:
        """The reply may be a function call (tools with a choice other than none): its text is held back."""
        return self.tools is not None and self.tools.choice != "none"


def parse_client_event(message: str | bytes, max_bytes: int) -> dict[str, Any]:
    """One text frame -> a JSON object with a known string `type`."""
    if isinstance(message, bytes):
        raise ProtocolError("invalid_frame", "binary frames are not part of this protocol; send each event as one "
                                             "JSON text frame")
    if len(message) > max_bytes:
        raise ProtocolError("event_too_large", f"the event is {len(message)} bytes; the limit is {max_bytes}")
    try:
        event = json.loads(message)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError("invalid_json", f"the event is not valid JSON: {e}") from None
    if not isinstance(event, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object with a 'type'")
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("missing_required_parameter", "the event has no 'type' string", param="type")
    if kind not in CLIENT_EVENTS:
        raise ProtocolError("invalid_event_type", f"unknown event type {kind!r}; known: {sorted(CLIENT_EVENTS)}",
                            param="type")
    event_id = event.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise ProtocolError("invalid_value", "event_id must be a string", param="event_id")
    return event


def is_beta_session(session: dict[str, Any]) -> bool:
    return "type" not in session and any(key in BETA_SESSION_KEYS for key in session)


def apply_session_update(config: SessionConfig, session: Any, *, model: str, voices: tuple[str, ...],
                         max_tokens_cap: int, voice_locked: bool,
                         tool_choices: frozenset[str] = FORCED_CHOICES) -> SessionConfig:
    """`session.update`'s `session` (GA or beta shape) over `config`. Raises ProtocolError naming the field.
    `tool_choices`: the tool choices the voice's chat model serves (`FORCED_CHOICES` plus auto when its template
    has a tool format; none at all for a model that takes no tools)."""
    if not isinstance(session, dict):
        raise ProtocolError("invalid_value", "session must be an object", param="session")
    known = GA_SESSION_KEYS | BETA_SESSION_KEYS | IGNORED_SESSION_KEYS | TOOL_KEYS | {"model", "instructions"}
    unknown = sorted(set(session) - known)
    if unknown:
        raise ProtocolError("unknown_parameter", f"unknown session parameter(s) {unknown}",
                            param=f"session.{unknown[0]}")
    values: dict[str, Any] = {}
    if session.get("type", "realtime") != "realtime":
        raise ProtocolError("unsupported_value", f"session.type {session['type']!r} is not served here; use 'realtime'",
                            param="session.type")
    if session.get("model") not in (None, model):
        raise ProtocolError("invalid_value", f"the session's model is {model!r} (set by the connection URL); it cannot "
                                             f"change to {session['model']!r}", param="session.model")
    if TOOL_KEYS & set(session):
        values["tools"], values["tool_choice"] = parse_tools(session, config, "session", tool_choices)
    if "instructions" in session:
        values["instructions"] = check_text(session["instructions"], "session.instructions", MAX_INSTRUCTIONS_CHARS)
    for key in ("output_modalities", "modalities"):
        if key in session:
            values["output_modalities"] = modalities(session[key], f"session.{key}")
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in session:
            values["max_output_tokens"] = max_tokens(session[key], f"session.{key}", max_tokens_cap)
    if "temperature" in session:
        values["temperature"] = check_number(session["temperature"], "session.temperature", 0.0, 2.0)
    audio = session.get("audio", {})
    if not isinstance(audio, dict):
        raise ProtocolError("invalid_value", "session.audio must be an object", param="session.audio")
    inp, out = audio.get("input", {}), audio.get("output", {})
    for part, where in ((inp, "session.audio.input"), (out, "session.audio.output")):
        if not isinstance(part, dict):
            raise ProtocolError("invalid_value", f"{where} must be an object", param=where)
    if "format" in inp:
        values["input_format"] = audio_format(inp["format"], "session.audio.input.format")
    if "input_audio_format" in session:
        values["input_format"] = audio_format(session["input_audio_format"], "session.input_audio_format")
    if "format" in out:
        values["output_format"] = audio_format(out["format"], "session.audio.output.format")
    if "output_audio_format" in session:
        values["output_format"] = audio_format(session["output_audio_format"], "session.output_audio_format")
    for value, where in ((inp.get("turn_detection", ...), "session.audio.input.turn_detection"),
                         (session.get("turn_detection", ...), "session.turn_detection")):
        if value is not ...:
            values["turn_detection"] = parse_turn_detection(value, config.turn_detection, where)
    for value, where in ((inp.get("transcription", ...), "session.audio.input.transcription"),
                         (session.get("input_audio_transcription", ...), "session.input_audio_transcription")):
        if isinstance(value, dict):
            values["transcription_language"] = check_optional_text(value.get("language"), f"{where}.language", 16)
            values["transcription_prompt"] = check_optional_text(value.get("prompt"), f"{where}.prompt", 1024)
        elif value is not ... and value is not None:
            raise ProtocolError("invalid_value", f"{where} must be an object or null", param=where)
    for value, where in ((out.get("voice", ...), "session.audio.output.voice"),
                         (session.get("voice", ...), "session.voice")):
        if value is not ...:
            name = value.get("id") if isinstance(value, dict) else value
            if name not in voices:
                raise ProtocolError("invalid_value", f"voice {name!r} is not a voice of this model; its voices: "
                                                     f"{list(voices)}", param=where)
            if voice_locked and name != config.voice:
                raise ProtocolError("invalid_value", "the voice cannot change once the session has produced audio",
                                    param=where)
            values["voice"] = name
    for value, where in ((out.get("speed", ...), "session.audio.output.speed"),
                         (session.get("speed", ...), "session.speed")):
        if value is not ...:
            values["speed"] = check_number(value, where, 0.25, 1.5)
    return replace(config, **values)


def parse_response_params(response: Any, config: SessionConfig, max_tokens_cap: int,
                          tool_choices: frozenset[str] = FORCED_CHOICES) -> ResponseParams:
    """`response.create`'s optional `response` object over the session's configuration (its `tools` and
    `tool_choice` apply to this response only)."""
    if response is None:
        response = {}
    if not isinstance(response, dict):
        raise ProtocolError("invalid_value", "response must be an object", param="response")
    allowed = {"output_modalities", "modalities", "instructions", "max_output_tokens", "max_response_output_tokens",
               "conversation", "metadata", "input", "temperature", "tool_choice", "tools", "voice", "audio",
               "output_audio_format", "prompt", "parallel_tool_calls"}
    unknown = sorted(set(response) - allowed)
    if unknown:
        raise ProtocolError("unknown_parameter", f"unknown response parameter(s) {unknown}",
                            param=f"response.{unknown[0]}")
    tools = config.tools
    if TOOL_KEYS & set(response):
        tools = parse_tools(response, config, "response", tool_choices)[0]
    for key in ("voice", "audio", "output_audio_format"):
        if response.get(key):
            raise ProtocolError("unsupported_value", f"response.{key}: set the voice and audio format with "
                                                     "session.update", param=f"response.{key}")
    mods = config.output_modalities
    for key in ("output_modalities", "modalities"):
        if key in response:
            mods = modalities(response[key], f"response.{key}")
    tokens = config.max_output_tokens
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in response:
            tokens = max_tokens(response[key], f"response.{key}", max_tokens_cap)
    conversation = response.get("conversation", "auto")
    if conversation not in ("auto", "none"):
        raise ProtocolError("invalid_value", "response.conversation must be 'auto' or 'none'",
                            param="response.conversation")
    metadata = response.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise ProtocolError("invalid_value", "response.metadata must map at most 16 keys (<= 64 characters) to strings "
                                             "(<= 512 characters)", param="response.metadata")
    items = response.get("input")
    if items is not None:
        if not isinstance(items, list) or len(items) > 256:
            raise ProtocolError("invalid_value", "response.input must be a list of at most 256 items",
                                param="response.input")
        items = tuple(parse_item(item, f"response.input[{i}]", allow_audio=False) for i, item in enumerate(items))
    instructions = config.instructions
    if "instructions" in response:
        instructions = check_text(response["instructions"], "response.instructions", MAX_INSTRUCTIONS_CHARS)
    temperature = config.temperature
    if "temperature" in response:
        temperature = check_number(response["temperature"], "response.temperature", 0.0, 2.0)
    return ResponseParams(mods, instructions, tokens, temperature, conversation, metadata, items, tools)


def parse_tools(fields: dict[str, Any], config: SessionConfig, scope: str,
                tool_choices: frozenset[str]) -> tuple[Tools | None, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a session.update or response.create (realtime's flat
    shape: `{type: "function", name, description, parameters}`, `{type: "function", name}`) over the session's ->
    (Tools or None, the tool_choice as sent). Checked as chat's are (pipelines/tools.py, through their chat shape);
    errors name the field under `scope`."""
    tools = fields.get("tools", ...)
    if tools is ...:
        tools = [wire_tool(f) for f in config.tools.functions] if config.tools is not None else None
    choice = fields.get("tool_choice", config.tool_choice)
    parallel = fields.get("parallel_tool_calls", None if config.tools is None else config.tools.parallel)
    if tools is not None and not isinstance(tools, list):
        raise ProtocolError("invalid_value", f"{scope}.tools must be a list of functions", param=f"{scope}.tools")
    chat_tools = []
    for i, tool in enumerate(tools or ()):
        where = f"{scope}.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ProtocolError("unsupported_value", f"{where} must be {{\"type\": \"function\", \"name\", "
                                "\"description\", \"parameters\"}} (only function tools are served)", param=where)
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters"})
        if unknown:
            raise ProtocolError("unknown_parameter", f"unknown {where} parameter(s) {unknown}",
                                param=f"{where}.{unknown[0]}")
        chat_tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    chat_choice = choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError("invalid_value", f"{scope}.tool_choice must be auto, none, required or "
                                "{\"type\": \"function\", \"name\": ...}", param=f"{scope}.tool_choice")
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    try:
        parsed = Tools.parse(chat_tools or None, None if chat_choice == "auto" and not chat_tools else chat_choice,
                             parallel)
    except RequestError as exc:
        param = f"{scope}.{exc.param.replace('.function.', '.')}"
        message = exc.message.replace("tools[", f"{scope}.tools[").replace(".function.", ".")
        raise ProtocolError(exc.code, message, param=param) from None
    if parsed is not None and parsed.choice not in tool_choices:
        if not tool_choices:
            raise ProtocolError("unsupported_value", "this voice's model takes no tools (function calling is served "
                                "by cascade voices)", param=f"{scope}.tools")
        raise ProtocolError("unsupported_value", "tool_choice auto needs a chat model whose template renders tool "
                            "calls, so that they can be read back; this voice's does not: use tool_choice required or "
                            "a named function", param=f"{scope}.tools")
    return parsed, choice


def wire_tool(function) -> dict[str, Any]:
    """A function (pipelines.tools.Function) in realtime's flat shape."""
    return {"type": "function", "name": function.name, "description": function.description,
            "parameters": function.schema()}


def parse_function_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` or `function_call_output` item of `conversation.item.create` -> {"id", "type", "call_id",
    "name", "arguments", "output"} (the client runs the tool and sends its output as text)."""
    kind = item["type"]
    fields = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    unknown = sorted(set(item) - {"type", "id", "object", "status", *fields})
    if unknown:
        raise ProtocolError("unknown_parameter", f"unknown {where} parameter(s) {unknown}",
                            param=f"{where}.{unknown[0]}")
    item_id = item.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not 1 <= len(item_id) <= 64):
        raise ProtocolError("invalid_value", f"{where}.id must be a string of 1..64 characters", param=f"{where}.id")
    spec: dict[str, Any] = {"id": item_id, "type": kind, "name": "", "arguments": "", "output": ""}
    for key in fields:
        spec[key] = check_text(item.get(key), f"{where}.{key}", 64 if key in ("call_id", "name") else MAX_TEXT_CHARS)
    if not spec["call_id"]:
        raise ProtocolError("invalid_value", f"{where}.call_id must not be empty", param=f"{where}.call_id")
    return spec


def parse_item(item: Any, where: str, *, allow_audio: bool = True) -> dict[str, Any]:
    """A message item of `conversation.item.create` -> {"id", "role", "text" | "audio"}. Only messages are served:
    a role (system, user, assistant) and one content part of text (or, from a user, base64 audio)."""
    if not isinstance(item, dict):
        raise ProtocolError("invalid_value", f"{where} must be an object", param=where)
    if item.get("type", "message") != "message":
        raise ProtocolError("unsupported_value", f"{where}.type {item.get('type')!r} is not supported; only 'message' "
                                                 "items (no function calls)", param=f"{where}.type")
    role = item.get("role")
    if role not in ("system", "user", "assistant"):
        raise ProtocolError("invalid_value", f"{where}.role must be 'system', 'user' or 'assistant'; got {role!r}",
                            param=f"{where}.role")
    item_id = item.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not 1 <= len(item_id) <= 64):
        raise ProtocolError("invalid_value", f"{where}.id must be a string of 1..64 characters", param=f"{where}.id")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("invalid_value", f"{where}.content must be a non-empty list of content parts",
                            param=f"{where}.content")
    texts, audio = [], None
    for i, part in enumerate(content):
        p = f"{where}.content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "text", "output_text"):
            texts.append(check_text(part.get("text"), f"{p}.text", MAX_TEXT_CHARS))
        elif kind in ("audio", "output_audio") or (kind == "input_audio" and part.get("audio") is None):
            texts.append(check_text(part.get("transcript") or "", f"{p}.transcript", MAX_TEXT_CHARS))
        elif kind == "input_audio" and allow_audio and role == "user":
            if not isinstance(part.get("audio"), str) or audio is not None:
                raise ProtocolError("invalid_value", f"{p}.audio must be base64 audio (one audio part per item)",
                                    param=f"{p}.audio")
            audio = part["audio"]
        else:
            raise ProtocolError("invalid_value", f"{p}.type {kind!r} is not a content type of a {role} message here",
                                param=f"{p}.type")
    return {"id": item_id, "role": role, "text": " ".join(t for t in texts if t), "audio": audio}


def modalities(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not set(value) <= {"text", "audio"}:
        raise ProtocolError("invalid_value", f"{where} must be ['audio'] or ['text'] (audio comes with its transcript)",
                            param=where)
    return ("audio",) if "audio" in value else ("text",)


def max_tokens(value: Any, where: str, cap: int) -> int:
    if value == "inf":
        return cap
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ProtocolError("invalid_value", f"{where} must be an integer in 1..4096 or 'inf'", param=where)
    return min(value, cap)


def audio_format(value: Any, where: str) -> AudioFormat:
    if isinstance(value, str) and value in FORMATS:
        return FORMATS[value]
    if isinstance(value, dict) and value.get("type") in GA_FORMATS:
        fmt = GA_FORMATS[value["type"]]
        if value.get("rate", fmt.rate) != fmt.rate:
            raise ProtocolError("invalid_value", f"{where}.rate: {fmt.ga_type} is {fmt.rate} Hz", param=f"{where}.rate")
        return fmt
    raise ProtocolError("invalid_value", f"{where} must be one of {list(FORMATS)} or {{'type': one of "
                                         f"{list(GA_FORMATS)}}}", param=where)


def session_object(config: SessionConfig, *, session_id: str, model: str) -> dict[str, Any]:
    """The effective configuration, as `session.created` / `session.updated` carry it (GA or beta shape)."""
    td = config.turn_detection.wire() if config.turn_detection is not None else None
    transcription = {"model": model, "language": config.transcription_language, "prompt": config.transcription_prompt}
    max_tokens_value = config.max_output_tokens
    tools = [wire_tool(f) for f in config.tools.functions] if config.tools is not None else []
    if config.beta:
        return {"id": session_id, "object": "realtime.session", "model": model,
                "modalities": list(config.output_modalities)
                + (["text"] if "audio" in config.output_modalities else []),
                "instructions": config.instructions, "voice": config.voice,
                "input_audio_format": config.input_format.name, "output_audio_format": config.output_format.name,
                "input_audio_transcription": transcription, "turn_detection": td, "tools": tools,
                "tool_choice": config.tool_choice,
                "temperature": config.temperature, "max_response_output_tokens": max_tokens_value,
                "speed": config.speed}
    return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": list(config.output_modalities), "instructions": config.instructions,
            "audio": {"input": {"format": config.input_format.ga(), "transcription": transcription,
                                "turn_detection": td, "noise_reduction": None},
                      "output": {"format": config.output_format.ga(), "voice": config.voice, "speed": config.speed}},
            "tools": tools, "tool_choice": config.tool_choice, "max_output_tokens": max_tokens_value}


def event_name(name: str, beta: bool) -> str:
    return BETA_NAMES.get(name, name) if beta else name


def content_type(kind: str, beta: bool) -> str:
    return BETA_CONTENT.get(kind, kind) if beta else kind
