"""Constrained decoding: a request's `response_format` as a grammar that every sampled token must keep.

OpenAI's `response_format` (`json_object`; `json_schema` with its `schema`) and two extensions (`regex`, and
`grammar`: EBNF) become a `Grammar`, checked when the request's fields are read (a schema that is not JSON Schema,
or uses a keyword the compiler cannot enforce, is refused naming the keyword). Each model compiles a grammar once
(xgrammar, over the model's tokenizer and its logits' width; cached by the grammar), each constrained sequence
holds a matcher, and each step the sampler masks a constrained row's logits to the tokens its matcher accepts
(`Constraint`), so constrained and free rows share the step. The matcher takes every sampled token; a grammar
that is complete leaves only the end tokens, and the sequence ends "stop" when its matcher terminates.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json_object", "json_schema", "regex", "grammar")
# JSON Schema keywords the compiler enforces (or that only annotate): any other keyword is refused, naming it
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref",
    "$defs", "definitions", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties",
    "maxProperties", "title", "description", "default", "examples", "$schema", "$id", "$comment", "nullable",
})
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names to schemas
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords whose values list schemas
MAX_SOURCE = 64 * 1024  # characters of a schema, regex or grammar
CACHE_SIZE = 256  # compiled grammars a model keeps


@dataclass(frozen=True)
class Grammar:
    """What a constrained request's output must match: `kind` (KINDS) and its `source` (the schema as compact
    JSON, the regex or the EBNF grammar; empty for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"response_format.type must be one of {['text', *KINDS]}, got {self.kind!r}")
        if len(self.source) > MAX_SOURCE:
            raise ValueError(f"response_format is {len(self.source)} characters; the limit is {MAX_SOURCE}")
        if self.kind == "json_schema":
            check_schema(json.loads(self.source), "response_format.json_schema.schema")
        elif self.kind in ("regex", "grammar") and not self.source:
            raise ValueError(f"response_format.{self.kind} must be a non-empty string")

    @classmethod
    def from_response_format(cls, value: Any) -> Grammar | None:
        """OpenAI's `response_format` object (and the regex / grammar extensions) -> a Grammar; `text` -> None.
        ValueErrors start with the field they are about."""
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise ValueError("response_format must be an object with a type: text, json_object, json_schema, regex "
                             "or grammar")
        kind = value["type"]
        allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
                   "regex": {"type", "regex"}, "grammar": {"type", "grammar"}}.get(kind)
        if allowed is None:
            raise ValueError(f"response_format.type must be one of {['text', *KINDS]}, got {kind!r}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"response_format has unknown field(s) {unknown} for type {kind!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object {name, schema, strict}")
            extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
            if extra:
                raise ValueError(f"response_format.json_schema has unknown field(s) {extra}")
            return cls("json_schema", json.dumps(spec.get("schema", {}), separators=(",", ":"), sort_keys=True))
        source = value.get(kind)
        if not isinstance(source, str):
            raise ValueError(f"response_format.{kind} must be a string")
        return cls(kind, source)


def check_schema(schema: Any, where: str) -> None:
    """A JSON Schema the compiler can enforce: valid (Draft 2020-12 meta-schema) and made of SCHEMA_KEYWORDS only
    (ValueError naming `where` and the first other keyword)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON Schema: {exc.message}") from None

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key not in SCHEMA_KEYWORDS:
                raise ValueError(f"{where} uses the keyword {key!r} at {path or '/'}, which constrained decoding does "
                                 f"not support; supported: {sorted(SCHEMA_KEYWORDS)}")
            if key in SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    walk(sub, f"{path}/{key}/{name}")
            elif key in SCHEMA_LISTS and isinstance(value, list):
                for i, sub in enumerate(value):
                    walk(sub, f"{path}/{key}/{i}")
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                walk(value, f"{path}/{key}")

    walk(schema, "")


class Grammars:
    """One model's grammar compiler: its tokenizer's vocabulary over the logits' width (`vocab_size`), the end
    tokens a complete grammar allows, and the compiled grammars (an LRU of CACHE_SIZE)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None  # `bitmask`'s buffer
        self.compile_seconds: list[float] = []  # the cold compiles' times (examples/bench_structured.py)
        # xgrammar's JSON strings with a maxLength take any character but quote, backslash, CR and LF, so a byte
        # token of another control character (byte-level vocabularies have one per byte) would make JSON that
        # strict parsers refuse. Compact JSON needs no control character at all: JSON rows never sample one.
        self.control_tokens = torch.tensor([i for i, text in enumerate(self.info.decoded_vocab)
                                            if any(b < 0x20 for b in text) and i not in stop_token_ids],
                                           dtype=torch.long)

    def compile(self, grammar: Grammar):
        """The grammar compiled for this model (cached); ValueError naming `response_format` if it cannot be."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        started = time.perf_counter()
        try:
            if grammar.kind in ("json_object", "json_schema"):  # compact: no whitespace between tokens of JSON
                schema = grammar.source if grammar.kind == "json_schema" else '{"type":"object"}'
                compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            elif grammar.kind == "regex":
                compiled = self.compiler.compile_regex(grammar.source)
            else:
                compiled = self.compiler.compile_grammar(grammar.source)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"response_format cannot be compiled into a grammar: {exc}") from None
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - started)
            self._compiled[grammar] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def bitmask(self, rows: int) -> torch.Tensor:
        """A token bitmask of at least `rows` rows, reused from step to step (one step at a time uses it)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 16), self.vocab_size)
        return self._bitmask

    def matcher(self, grammar: Grammar):
        """A fresh matcher of the grammar, for one sequence."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(grammar))


class Constraint:
    """One step's masks: the rows (of the step's sampled rows) under a grammar, their matchers, and which of them
    make JSON (`json`: those never sample a control-character token, `Grammars.control_tokens`). `apply` masks
    those rows of logits [rows, V] in place to the tokens each may take next."""

    def __init__(self, grammars: Grammars, rows: list[int], matchers: list, json: list[bool]):
        self.grammars, self.rows, self.json = grammars, rows, json
        self.bitmask = grammars.bitmask(max(rows) + 1)  # row r of the step's rows: its mask at row r
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(self.bitmask, row)

    def apply(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device), indices=self.rows)
        control = self.grammars.control_tokens.to(logits.device)
        json_rows = [row for row, is_json in zip(self.rows, self.json) if is_json]
        if len(control) and json_rows:
            rows = torch.tensor(json_rows, dtype=torch.long, device=logits.device)
            logits[rows[:, None], control[None, :]] = -torch.inf
