"""Wire schemas of /v1/chat/completions and /v1/completions: OpenAI's fields, mmserve's extensions,
and the reply objects (`chat.completion`, `chat.completion.chunk`, `text_completion`).

Ranges are checked in one place, `stages.llm.params.SamplingParams`: its ValueError starts with
the field's name, and `sampling_params` turns it into a 400 naming the field the client sent.
Unknown fields are refused, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelines.image_request import MAX_LORAS, RequestError
from pipelines.token_texts import TokenTexts
from serve.schemas import LoraRef
from stages.llm.grammar import Grammar
from stages.llm.params import MAX_N, SamplingParams

# SamplingParams fields a request may set under the same name.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "n")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # one last chunk with empty choices and the request's usage
    include_obfuscation: bool | None = None  # accepted, ignored: chunks carry no obfuscation padding


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. None means "the default" (SamplingParams' own)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # -- OpenAI fields --------------------------------------------------------------------
    model: str | None = None  # None: the server's first chat model
    stream: bool = False  # server-sent events, ending with `data: [DONE]`
    stream_options: StreamOptions | None = None  # only with stream=true
    max_tokens: int | None = None  # None: up to the context limit
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON string key) -> bias; -100 bans
    user: str | None = None  # accepted; never a metric label
    safety_identifier: str | None = None  # accepted; the newer name of `user`
    # -- mmserve extensions (vLLM's names) -------------------------------------------------
    top_k: int | None = None  # -1: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # the model's LoRA adapters, weighted (or name one in `model`: "base:adapter", vLLM's convention)
    lora: list[LoraRef] | None = Field(None, max_length=MAX_LORAS)
    # constrained output: OpenAI's {type: text | json_object | json_schema} and mmserve's {type: regex | grammar}
    response_format: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def lora_entries(self, adapter: str | None) -> tuple[tuple[str, float | None], ...]:
        """The request's adapters: the one its model id names first, then the `lora` field's."""
        named = ((adapter, None),) if adapter is not None else ()
        return named + tuple((ref.name, ref.scale) for ref in self.lora or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> tuple[int | None, str]:
        """The length limit and the field it came from."""
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> dict[str, Any]:
        """SamplingParams' logprobs/top_logprobs for this endpoint's own logprobs fields."""
        return {}

    def _param_names(self) -> dict[str, str]:
        """SamplingParams field -> the request field a client would recognise."""
        return {}

    def sampling_params(self) -> SamplingParams:
        """Build and check SamplingParams (the model checks token ids against its vocabulary). Raises RequestError."""
        values = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        max_tokens, max_name = self._max_tokens()
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        values.update(self._logprobs())
        names = {"max_tokens": max_name, **self._param_names()}
        if self.response_format is not None:
            try:
                values["response_format"] = Grammar.from_response_format(self.response_format)
            except (ValueError, json.JSONDecodeError) as e:
                raise RequestError(str(e).split(" ")[0], str(e)) from None
        try:
            params = SamplingParams(**values)
        except ValueError as e:
            field, _, rest = str(e).partition(" ")
            if field not in SamplingParams.__dataclass_fields__:
                raise RequestError(None, str(e)) from None
            sent = names.get(field, field)  # the message names the field the client sent, as param does
            raise RequestError(sent, f"{sent} {rest}") from None
        return params


# OpenAI's chat audio.format values -> stages.media.audio_encode formats
SPOKEN_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm16": "pcm"}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[Any]  # OpenAI chat messages; each is checked (role, content) by the engine
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool | None = None  # per-token log-probabilities in choices[].logprobs.content
    top_logprobs: int | None = None  # alternatives per position; needs logprobs=true
    tools: list[Any] | None = None  # functions the model may call: [{type: "function", function: {name, ...}}]
    tool_choice: str | dict[str, Any] | None = None  # none | auto (the default with tools) | required | a function
    parallel_tool_calls: bool | None = None  # several calls in one reply (default true)
    modalities: list[str] | None = None  # OpenAI's output kinds: ["text"] (the default) or ["text", "audio"]
    audio: dict[str, Any] | None = None  # OpenAI's audio output options {voice, format}: with "audio" modalities

    def tool_spec(self):
        """The request's tools (pipelines.tools.Tools), or None; RequestErrors name the field."""
        from pipelines.tools import Tools

        return Tools.parse(self.tools, self.tool_choice, self.parallel_tool_calls)

    def speech_output(self, model: str, speaks: bool):
        """The spoken reply asked for (pipelines.omni.SpeechOutput), or None for text only. RequestErrors name the
        field: modalities beyond ["text", "audio"], audio output from a model that does not speak, an `audio`
        object without the audio modality, a format we cannot write, streaming with audio (not yet)."""
        import secrets

        from pipelines.omni import SpeechOutput, not_speaking

        modalities = self.modalities or ["text"]
        if any(m not in ("text", "audio") for m in modalities) or "text" not in modalities:
            raise RequestError("modalities", f"modalities must be [\"text\"] or [\"text\", \"audio\"]; got "
                               f"{self.modalities}")
        if "audio" not in modalities:
            if self.audio is not None:
                raise RequestError("audio", "audio (the voice and format of spoken output) needs modalities "
                                   "[\"text\", \"audio\"]")
            return None
        if not speaks:
            raise not_speaking(model)
        audio = self.audio or {}
        unknown = sorted(set(audio) - {"voice", "format"})
        if unknown:
            raise RequestError("audio", f"audio has unknown field(s) {unknown}; allowed: ['voice', 'format']")
        if not isinstance(audio.get("voice"), str):
            raise RequestError("audio.voice", "audio.voice must name one of the model's voices")
        if audio.get("format", "wav") not in SPOKEN_FORMATS:
            raise RequestError("audio.format", f"audio.format must be one of {list(SPOKEN_FORMATS)}; got "
                               f"{audio.get('format')!r}")
        if self.stream and audio.get("format", "wav") != "pcm16":
            raise RequestError("audio.format", "a streamed spoken reply is pcm16 (24 kHz, 16-bit, mono), as OpenAI "
                               f"streams it; got {audio.get('format', 'wav')!r}")
        return SpeechOutput(audio["voice"], self.seed if self.seed is not None else secrets.randbits(31),
                            stream=bool(self.stream))

    @property
    def audio_format(self) -> str:
        return (self.audio or {}).get("format", "wav")

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is None:
            return self.max_tokens, "max_tokens"
        if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_completion_tokens", "max_tokens and max_completion_tokens differ; send only "
                               "max_completion_tokens (max_tokens is its older name)")
        return self.max_completion_tokens, "max_completion_tokens"

    def _logprobs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.top_logprobs is not None:
            out["top_logprobs"] = self.top_logprobs
        return out


class CompletionRequest(SamplingFields):
    """POST /v1/completions (legacy): one prompt (text or token ids) or a list of them, run together."""

    prompt: Any  # a string, a list of token ids, or a list of those (see prompt_fields)
    logprobs: int | None = None  # top alternatives per position (0: the chosen token's only)
    echo: bool = False  # only false: the prompt is not echoed (no prompt logprobs are computed)
    best_of: int | None = None  # only equal to n (or null): each returned choice is one sampled sequence
    suffix: str | None = None  # only null: no insertion (fill-in-the-middle) support

    def prompt_fields(self) -> dict[str, Any]:
        """ChatRequest's `prompt` (one string or token-id list) or `prompts` (a list of them, as OpenAI takes:
        strings and token-id lists; choice k * n + j is prompt k's j-th). Raises RequestError naming prompt[i]."""
        v = self.prompt
        if isinstance(v, str):
            return {"prompt": v}
        if not isinstance(v, list) or not v:
            raise RequestError("prompt", "prompt must be a string, a list of token ids, or a list of strings or of "
                               f"token-id lists; got {_kind(v)}")
        if _is_token(v[0]):  # one prompt of token ids
            for i, t in enumerate(v):
                if not _is_token(t):
                    raise RequestError(f"prompt[{i}]", f"a prompt of token ids holds integers only; prompt[{i}] is "
                                       f"{_kind(t)}")
            return {"prompt": v}
        for i, p in enumerate(v):
            if not (isinstance(p, str) or isinstance(p, list) and all(_is_token(t) for t in p)):
                raise RequestError(f"prompt[{i}]", f"each prompt of a list must be a string or a list of token ids "
                                   f"(integers); prompt[{i}] is {_kind(p)}")
        n = self.n or 1
        if len(v) * n > MAX_N:
            raise RequestError("prompt", f"{len(v)} prompts with n={n} make {len(v) * n} choices; at most {MAX_N} "
                               "per request")
        return {"prompts": v}

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported; the reply holds the completion only")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("suffix is not supported (no fill-in-the-middle); leave it null")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info) -> int | None:
        if v is not None and v != (info.data.get("n") or 1):
            raise ValueError("best_of must equal n (or be null): every sampled sequence is returned")
        return v

    def _logprobs(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        return {"logprobs": True, "top_logprobs": self.logprobs}

    def _param_names(self) -> dict[str, str]:
        return {"logprobs": "logprobs", "top_logprobs": "logprobs"}


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return ("an empty list" if not value
                else "a list holding " + ", ".join(sorted({type(x).__name__ for x in value})))
    return f"{type(value).__name__} {value!r}"[:80]


# -- replies ------------------------------------------------------------------------------

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)
def _logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def usage_body(usage: dict[str, int]) -> dict[str, Any]:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}


class TextReply:
    """The reply objects of one request, whole (`body`) or as stream chunks (`opening`, `delta`, `closing`).

    Engine events: DELTA {"index", "text", "finish_reason"[, "logprobs"]}; FINAL outputs {"choices", "usage"}.
    A DELTA without a finish reason carries exactly its own token's logprobs; the finishing one may not
    (EOS adds none), so a choice's last logprobs are taken from FINAL, past those already streamed.
    """

    object = ""  # the non-streamed object type
    chunk_object = ""  # the streamed object type

    def __init__(self, reply_id: str, model: str, tokens: TokenTexts, params: SamplingParams, *,
                 include_usage: bool):
        self.id = reply_id
        self.model = model
        self.created = int(time.time())
        self.tokens = tokens  # the model's token id -> (text, bytes), for logprobs
        self.n = params.n
        self.wants_logprobs = params.logprobs
        self.include_usage = include_usage
        self._streamed: dict[int, int] = {}  # choice index -> logprob entries already sent

    # -- whole ------------------------------------------------------------------------------
    def body(self, outputs: dict[str, Any]) -> dict[str, Any]:
        choices = [self._choice(c["index"], c["text"], c["finish_reason"], self._logprobs(c["index"], c["logprobs"]))
                   for c in outputs["choices"]]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_body(outputs["usage"])}

    # -- streamed ---------------------------------------------------------------------------
    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, data: dict[str, Any]) -> dict[str, Any] | None:
        index = data["index"]
        entries = []
        if self.wants_logprobs and data["finish_reason"] is None and "logprobs" in data:
            entries = [data["logprobs"]]
            self._streamed[index] = self._streamed.get(index, 0) + 1
        if not data["text"] and not entries:
            return None  # text held back (a partial character or a possible stop string) and nothing else
        logprobs = self._logprobs(index, entries) if entries else None
        return self._chunk([self._chunk_choice(index, data["text"], None, logprobs)])

    def closing(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        """One finish chunk per choice (with its remaining logprobs), then usage when asked for."""
        chunks = []
        for c in outputs["choices"]:
            rest = (c["logprobs"] or [])[self._streamed.get(c["index"], 0):]
            logprobs = self._logprobs(c["index"], rest) if rest else None
            chunks.append(self._chunk([self._chunk_choice(c["index"], "", c["finish_reason"], logprobs)]))
        if self.include_usage:
            chunks.append(self._chunk([], usage=usage_body(outputs["usage"])))
        return chunks

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return chunk

    # -- per endpoint -----------------------------------------------------------------------
    def _choice(self, index: int, text: str, finish_reason: str, logprobs) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, index: int, entries: list[dict[str, Any]] | None):
        raise NotImplementedError


class ChatReply(TextReply):
    """Chat replies; with tools (`tools` set, choice not none) a choice's text is held back while streaming and
    goes out at its end as its content and its `delta.tool_calls` (the calls are read from the whole text)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.holds = tools is not None and tools.choice != "none"

    def body(self, outputs: dict[str, Any]) -> dict[str, Any]:
        payload = super().body(outputs)
        for choice, c in zip(payload["choices"], outputs["choices"]):
            if "tool_calls" in c:
                choice["message"]["content"] = c["content"]
                choice["message"]["tool_calls"] = c["tool_calls"]
        return payload

    def delta(self, data: dict[str, Any]) -> dict[str, Any] | None:
        return None if self.holds else super().delta(data)

    def closing(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        held = []
        for c in outputs["choices"] if self.holds else ():
            content = c.get("content", c["text"])
            if content:
                held.append(self._chunk([{"index": c["index"], "delta": {"content": content}, "logprobs": None,
                                          "finish_reason": None}]))
            calls = [{"index": i, **call} for i, call in enumerate(c.get("tool_calls", ()))]
            if calls:
                held.append(self._chunk([{"index": c["index"], "delta": {"tool_calls": calls}, "logprobs": None,
                                          "finish_reason": None}]))
        return held + super().closing(outputs)

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def _choice(self, index, text, finish_reason, logprobs):
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _chunk_choice(self, index, text, finish_reason, logprobs):
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, index, entries):
        if not self.wants_logprobs:
            return None
        return {"content": [self._entry(e) for e in entries or ()]}

    def _entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.tokens(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

        return {**one(entry["token_id"], entry["logprob"]),
                "top_logprobs": [one(t, lp) for t, lp in entry.get("top_logprobs") or ()]}


class CompletionReply(TextReply):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, reply_id: str, model: str, tokens: TokenTexts, params: SamplingParams, *,
                 include_usage: bool):
        super().__init__(reply_id, model, tokens, params, include_usage=include_usage)
        self._offsets: dict[int, int] = {}  # choice index -> characters of token text so far

    def _choice(self, index, text, finish_reason, logprobs):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    _chunk_choice = _choice

    def _logprobs(self, index, entries):
        """Legacy shape: parallel lists; text_offset counts characters of token text from the completion's start."""
        if not self.wants_logprobs:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries or ():
            text, _ = self.tokens(e["token_id"])
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(e["logprob"]))
            out["top_logprobs"].append({self.tokens(t)[0]: _logprob(lp) for t, lp in e.get("top_logprobs") or ()})
            out["text_offset"].append(self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return out


class SpokenChatReply(ChatReply):
    """A streamed spoken reply in OpenAI's shape: the words as `delta.audio.transcript` pieces while the thinker
    writes, and the audio as `delta.audio.data` pieces of pcm16 (24 kHz mono), each a chunk token2wav made while the
    talker was still speaking (pipelines/omni.py, `SpeechOutput.stream`); then the finish chunk (and usage when
    asked). The pieces concatenate to the reply's waveform."""

    def __init__(self, *args, audio_id: str, expires_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.audio_id = audio_id
        self.expires_at = expires_at

    def delta(self, data: dict[str, Any]) -> dict[str, Any] | None:
        if "audio" in data:  # the vocoder's chunk
            import base64

            import numpy as np

            pcm = (np.clip(data["audio"].numpy(), -1, 1) * 32767).astype("<i2").tobytes()
            audio = {"id": self.audio_id, "data": base64.b64encode(pcm).decode(), "expires_at": self.expires_at}
            return self._chunk([{"index": 0, "delta": {"audio": audio}, "logprobs": None, "finish_reason": None}])
        if not data.get("text"):  # the talker's codes and token2wav's mels are the graph's own
            return None
        return self._chunk([{"index": data["index"], "delta": {"audio": {"transcript": data["text"]}},
                             "logprobs": None, "finish_reason": None}])
