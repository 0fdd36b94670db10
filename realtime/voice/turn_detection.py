"""A voice session's turn detection as the client sets it: OpenAI's `server_vad` (with the opt-in adaptive end of
turn, `sentence_silence_ms`), `semantic_vad` mapped onto it by its eagerness, or null (the client commits turns).
realtime/voice/vad.py applies it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from realtime.sessions import ProtocolError
from realtime.voice.fields import check_integer, check_number

# semantic_vad's eagerness -> (silence mid-phrase, silence after a sentence), ms: the adaptive end of turn
EAGERNESS = {"low": (2000, 600), "medium": (1200, 300), "auto": (1200, 300), "high": (800, 150)}


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad` as OpenAI defines it (None in SessionConfig: the client commits turns itself), or `semantic_vad`
    mapped onto it: the adaptive end of turn with the silences of its `eagerness` (EAGERNESS)."""

    threshold: float = 0.5  # speech probability a 32 ms window must reach
    prefix_padding_ms: int = 300  # audio kept before the detected start
    silence_duration_ms: int = 500  # silence that ends the turn (with sentence_silence_ms: mid-phrase)
    create_response: bool = True  # a response starts when the turn ends
    interrupt_response: bool = True  # speech during a response cancels it (barge-in)
    idle_timeout_ms: int | None = None  # a response starts by itself after this much silence past the last one
    sentence_silence_ms: int | None = None  # extension, opt-in: silence that ends a turn whose transcript ends a
    # sentence (vad.py: the adaptive end of turn)
    eagerness: str | None = None  # semantic_vad: what it was asked for (None: server_vad)

    def wire(self) -> dict[str, Any]:
        if self.eagerness is not None:
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        wire = {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}
        if self.sentence_silence_ms is not None:
            wire["sentence_silence_ms"] = self.sentence_silence_ms
        return wire


def parse_turn_detection(value: Any, current: TurnDetection | None, where: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("invalid_value", f"{where} must be an object or null", param=where)
    kind = value.get("type", "server_vad" if current is None or current.eagerness is None else "semantic_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise ProtocolError("unsupported_value", f"{where}.type {kind!r} is not supported; use 'server_vad', "
                                                 "'semantic_vad' or null (the client commits turns)",
                            param=f"{where}.type")
    semantic = kind == "semantic_vad"
    known = {"type", "create_response", "interrupt_response"} | ({"eagerness"} if semantic else {
        "threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms", "sentence_silence_ms"})
    unknown = sorted(set(value) - known)
    if unknown:
        raise ProtocolError("unknown_parameter", f"unknown {where} parameter(s) {unknown} for type {kind!r}",
                            param=f"{where}.{unknown[0]}")
    same_kind = current is not None and (current.eagerness is not None) == semantic
    base = current if same_kind else TurnDetection()
    values: dict[str, Any] = {}
    for key in ("create_response", "interrupt_response"):
        if key in value:
            if not isinstance(value[key], bool):
                raise ProtocolError("invalid_value", f"{where}.{key} must be true or false", param=f"{where}.{key}")
            values[key] = value[key]
    if semantic:
        eagerness = value.get("eagerness", base.eagerness or "auto")
        if eagerness not in EAGERNESS:
            raise ProtocolError("invalid_value", f"{where}.eagerness must be one of {list(EAGERNESS)}",
                                param=f"{where}.eagerness")
        phrase, sentence = EAGERNESS[eagerness]
        return replace(base, **values, eagerness=eagerness, silence_duration_ms=phrase, sentence_silence_ms=sentence,
                       idle_timeout_ms=None)
    if "threshold" in value:
        values["threshold"] = check_number(value["threshold"], f"{where}.threshold", 0.0, 1.0)
    for key, high in (("prefix_padding_ms", 5000), ("silence_duration_ms", 10000)):
        if key in value:
            values[key] = check_integer(value[key], f"{where}.{key}", 0, high)
    if "idle_timeout_ms" in value:
        v = value["idle_timeout_ms"]
        values["idle_timeout_ms"] = None if v is None else check_integer(v, f"{where}.idle_timeout_ms", 5000, 30000)
    if "sentence_silence_ms" in value:
        v, key = value["sentence_silence_ms"], f"{where}.sentence_silence_ms"
        values["sentence_silence_ms"] = None if v is None else check_integer(v, key, 0, 10000)
    return replace(base, **values)
