"""Hermes / Qwen (2.5, 3) tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
call; text before the first block is the content."""

from __future__ import annotations

import json
import re
from typing import Any

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def detect(template: str) -> bool:
    return "<tool_call>" in template


def parse(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    calls, kept = [], []
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            kept.append(match.group(0))
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            kept.append(match.group(0))
            continue
        calls.append((call["name"], call.get("arguments", {})))
    if not calls:
        return text, []
    content = (text[:text.index("<tool_call>")] + "".join(kept)).strip()
    return content or None, calls
