"""Text -> phrases for phrase-level speech synthesis.

A phrase ends at a sentence end (. ! ? … followed by a space, closing quotes and brackets kept)
or a line break. A sentence longer than the limit is cut at its last clause boundary
(, ; : — – followed by a space) within the limit, else at its last space, else hard at the
limit. The first phrase may have a lower limit, so the first audio of a long opening sentence
comes sooner, and may end at its first clause boundary once it is `first_clause_chars` long (a voice
turn's first audio then waits for a clause, not a sentence; shorter fragments sound clipped).
Common abbreviations ("Mr.", "e.g.", "p.m.") and initials ("J. Smith") do not end a sentence.

`PhraseSplitter` works incrementally (text arriving from a language model, token by token);
`split_phrases` is the same on a whole text: feeding a text in any pieces gives the same phrases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Sentence end: terminal punctuation (plus closing quotes/brackets) followed by whitespace, or a line break.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n")
_CLAUSE_END = re.compile(r"[,;:—–)][\"'”’]*(?=\s)|\s[—–-]+(?=\s)")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "no", "fig"})


@dataclass(frozen=True)
class PhraseLimits:
    max_chars: int = 200  # a phrase never exceeds this (cut at a clause or a space when it would)
    first_max_chars: int = 100  # the first phrase's limit: the first audio of a long opening comes sooner
    first_clause_chars: int | None = None  # the first phrase may end at a clause boundary this far in (None: no)

    def __post_init__(self):
        if not 1 <= self.first_max_chars <= self.max_chars:
            raise ValueError(f"phrase limits need 1 <= first_max_chars <= max_chars, got {self.first_max_chars} "
                             f"and {self.max_chars}")
        if self.first_clause_chars is not None and not 1 <= self.first_clause_chars <= self.first_max_chars:
            raise ValueError("phrase limits need 1 <= first_clause_chars <= first_max_chars, got "
                             f"{self.first_clause_chars}")


@dataclass
class PhraseSplitter:
    limits: PhraseLimits = PhraseLimits()
    _buffer: str = ""
    _emitted: int = field(default=0)  # phrases handed out so far (the first has its own limit)

    def feed(self, text: str) -> list[str]:
        """Add text; return the phrases that are complete now (maybe none)."""
        self._buffer += text
        return self._take(final=False)

    def flush(self) -> list[str]:
        """The text still held, as phrases (the end of the input ends the last one)."""
        return self._take(final=True)

    def _take(self, final: bool) -> list[str]:
        out: list[str] = []
        while True:
            self._buffer = self._buffer.lstrip()
            first = self._emitted == 0
            limit = self.limits.first_max_chars if first else self.limits.max_chars
            end = _sentence_end(self._buffer, limit)
            if first and self.limits.first_clause_chars is not None:  # the earlier of a sentence end and a clause
                clause = _clause_end(self._buffer, self.limits.first_clause_chars, limit)
                end = clause if end is None or (clause is not None and clause < end) else end
            if end is None and len(self._buffer) > limit:
                end = _cut_point(self._buffer, limit)
            if end is None:
                break
            self._emit(out, self._buffer[:end])
            self._buffer = self._buffer[end:]
        if final:
            self._emit(out, self._buffer)
            self._buffer = ""
        return out

    def _emit(self, out: list[str], phrase: str) -> None:
        phrase = " ".join(phrase.split())  # line breaks and runs of spaces -> one space
        if phrase:
            out.append(phrase)
            self._emitted += 1


def split_phrases(text: str, limits: PhraseLimits = PhraseLimits()) -> list[str]:
    splitter = PhraseSplitter(limits)
    return splitter.feed(text) + splitter.flush()


def ends_sentence(text: str) -> bool:
    """Whether `text` ends where the splitter would end a sentence (terminal punctuation, not an abbreviation)."""
    text = text.rstrip()
    last = None
    for last in _SENTENCE_END.finditer(text + " "):
        pass
    return last is not None and last.end() == len(text) and not (last.group().startswith(".")
                                                                  and _is_abbreviation(text, last.start()))


def _sentence_end(text: str, limit: int) -> int | None:
    """Index just after the first sentence end within `limit` characters, or None."""
    for m in _SENTENCE_END.finditer(text, 0, min(len(text), limit + 1)):
        if m.end() > limit:
            return None
        if m.group().startswith(".") and _is_abbreviation(text, m.start()):
            continue
        return m.end()
    return None


def _is_abbreviation(text: str, dot: int) -> bool:
    word = re.search(r"(\S+)$", text[:dot])
    if word is None:
        return False
    token = word.group(1).lower().lstrip("(\"'“‘")
    # listed words, initials ("J."), dotted letters ("e.g.", "p.m.", "U.S.")
    return (token in _ABBREVIATIONS or (len(token) == 1 and token.isalpha())
            or re.fullmatch(r"(\w\.)+\w", token) is not None)


def _clause_end(text: str, at_least: int, limit: int) -> int | None:
    """Index just after the first clause end at `at_least` to `limit` characters, or None."""
    return next((m.end() for m in _CLAUSE_END.finditer(text, 0, limit + 1) if at_least <= m.end() <= limit), None)


def _cut_point(text: str, limit: int) -> int:
    """Where to cut a phrase longer than `limit`: the last clause end, else the last space, else the limit."""
    clauses = [m.end() for m in _CLAUSE_END.finditer(text, 0, limit + 1) if m.end() <= limit]
    if clauses:
        return clauses[-1]
    space = text.rfind(" ", 1, limit + 1)
    return space if space > 0 else limit
