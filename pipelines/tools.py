"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on a chat request.

The model's chat template renders the tools and the conversation's calls and results (`role: "tool"` messages).
What the model says is read back by its template's tool format (pipelines/tool_formats/: Hermes / Qwen
`<tool_call>` JSON, Llama 3 JSON), found from the template's text. `tool_choice: "required"` or a named function
constrains the output with a grammar (stages/llm/grammar.py) to JSON calls of the given functions' schemas, so the
call always parses and needs no format: an array of `{"name", "arguments"}` (one call unless
`parallel_tool_calls`), or a named function's arguments object. A model whose template has no tool format serves
those two; `auto` is refused naming `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pipelines.image_request import RequestError
from stages.llm.grammar import Grammar, check_schema

CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's cap on tools
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: str  # its JSON Schema, as compact JSON (frozen: hashable)

    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI sends it (what chat templates read)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema()}}


@dataclass(frozen=True)
class Tools:
    """A request's tools: its functions, `choice` (none, auto, required, or function: `named`), and whether the
    model may call several at once."""

    functions: tuple[Function, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any, parallel: Any) -> Tools | None:
        """The request's fields -> Tools (None when no tools apply); RequestErrors name the field."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise RequestError("tool_choice", "tool_choice needs tools")
            return None
        if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
            raise RequestError("tools", f"tools must be a list of 1 to {MAX_TOOLS} functions")
        functions = []
        for i, tool in enumerate(tools):
            functions.append(_function(tool, f"tools[{i}]"))
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise RequestError("tools", f"function names must be unique; got {names}")
        if parallel is not None and not isinstance(parallel, bool):
            raise RequestError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
        choice, named = tool_choice if tool_choice is not None else "auto", None
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            named = function.get("name") if isinstance(function, dict) else None
            if not isinstance(named, str):
                raise RequestError("tool_choice", "tool_choice must be none, auto, required or {\"type\": "
                                   "\"function\", \"function\": {\"name\": ...}}")
            if named not in names:
                raise RequestError("tool_choice", f"tool_choice names the function {named!r}, which is not in "
                                   f"tools {names}")
            choice = "function"
        elif choice not in CHOICES:
            raise RequestError("tool_choice", f"tool_choice must be one of {list(CHOICES)} or a named function; "
                               f"got {choice!r}")
        return cls(tuple(functions), choice, named, True if parallel is None else parallel)

    @property
    def forced(self) -> bool:
        """The reply is a call (required, or a named function): its grammar makes it one."""
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template renders (none for tool_choice none)."""
        return None if self.choice == "none" else [f.openai() for f in self.functions]

    def grammar(self) -> Grammar | None:
        """A forced call's grammar: the named function's arguments, or an array of {name, arguments} calls."""
        if self.choice == "function":
            function = next(f for f in self.functions if f.name == self.named)
            return Grammar("json_schema", function.parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.schema()},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Grammar("json_schema", json.dumps(schema, separators=(",", ":"), sort_keys=True))

    def read(self, text: str, form) -> tuple[str | None, list[dict[str, Any]]]:
        """A reply's text -> (its content, its calls in OpenAI's shape). A forced call is the grammar's JSON; with
        auto the template's format (`form`: a pipelines.tool_formats module, or None) reads it."""
        if self.choice == "function":
            return None, [_call(str(self.named), json.loads(text))] if text else []
        if self.choice == "required":
            return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)] if text else []
        if self.choice == "none" or form is None:
            return text, []
        content, calls = form.parse(text, {f.name for f in self.functions})
        return content, [_call(name, arguments) for name, arguments in calls]


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise RequestError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{name, description, "
                           "parameters}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise RequestError(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    try:
        check_schema(parameters, f"{where}.function.parameters")
    except ValueError as e:
        raise RequestError(f"{where}.function.parameters", str(e)) from None
    description = function.get("description", "")
    if not isinstance(description, str):
        raise RequestError(f"{where}.function.description", f"{where}.function.description must be a string")
    return Function(name, description, json.dumps(parameters, separators=(",", ":"), sort_keys=True))


def _call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape: arguments as a JSON string."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else
                         json.dumps(arguments, separators=(",", ":"))}}


def checked_calls(messages: list[dict[str, Any]], raw: list[Any]) -> None:
    """The conversation's calls and results: an assistant's `tool_calls` are well formed, and every `tool`
    message answers a call made before it (its `tool_call_id`); RequestErrors name the field."""
    made: set[str] = set()
    for i, (message, original) in enumerate(zip(messages, raw)):
        where = f"messages[{i}]"
        calls = original.get("tool_calls") if isinstance(original, dict) else None
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls", f"{where}.tool_calls must be a list on an assistant message")
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(function, dict) \
                        or not isinstance(function.get("name"), str) \
                        or not isinstance(function.get("arguments"), (str, dict)):
                    raise RequestError(f"{where}.tool_calls[{j}]", f"{where}.tool_calls[{j}] must be {{id, type: "
                                       "\"function\", function: {name, arguments}}")
                made.add(call["id"])
            message["tool_calls"] = calls
        if message["role"] == "tool":
            call_id = original.get("tool_call_id")
            if call_id not in made:
                raise RequestError(f"{where}.tool_call_id", f"{where}.tool_call_id must answer a call of an earlier "
                                   f"assistant message; got {call_id!r}")
            message["tool_call_id"] = call_id


def with_calls(outputs: dict[str, Any], tools: Tools, form) -> dict[str, Any]:
    """A reply's outputs with each choice's calls read from its text: `tool_calls` and `content` added, and
    finish_reason "tool_calls" for a choice that made one (a reply cut at max_tokens keeps its text and "length")."""
    for choice in outputs["choices"]:
        if choice["finish_reason"] == "length" and tools.forced:
            continue  # the grammar's JSON is unfinished: nothing to read
        content, calls = tools.read(choice["text"], form)
        choice["content"] = content
        if calls:
            choice["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
    return outputs
