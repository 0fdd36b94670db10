"""Checks of client event fields for the voice protocol: each returns the value or raises ProtocolError naming the
field (`where`) and the limit."""

from __future__ import annotations

import math
from typing import Any

from realtime.sessions import ProtocolError


def check_text(value: Any, where: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError("invalid_value", f"{where} must be a string", param=where)
    if len(value) > limit:
        raise ProtocolError("string_above_max_length", f"{where} is {len(value)} characters; the limit is {limit}",
                            param=where)
    return value


def check_optional_text(value: Any, where: str, limit: int) -> str | None:
    return None if value is None else check_text(value, where, limit)


def check_number(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ProtocolError("invalid_value", f"{where} must be a number in [{low}, {high}]; got {value!r}", param=where)
    return float(value)


def check_integer(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError("invalid_value", f"{where} must be an integer in [{low}, {high}]; got {value!r}",
                            param=where)
    return value
