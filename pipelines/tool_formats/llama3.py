"""Llama 3.1+ JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`; several separated by `;`)."""

from __future__ import annotations

import json
from typing import Any

TAG = "<|python_tag|>"


def detect(template: str) -> bool:
    return "Environment: ipython" in template or TAG in template


def parse(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    body = text.strip()
    body = body[len(TAG):].strip() if body.startswith(TAG) else body
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        try:
            call = json.loads(part)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or call.get("name") not in names:
            return text, []
        calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
    return None, calls
