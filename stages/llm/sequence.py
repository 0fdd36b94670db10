"""One generated sequence: its tokens, how many of them have KV, its blocks and its stop state."""

from __future__ import annotations

import enum
from collections import abc
from dataclasses import dataclass, field
from typing import Any

import torch


class SeqStatus(str, enum.Enum):
    WAITING = "waiting"  # admitted (capacity reserved), no blocks yet, or preempted back here
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"  # stopped (stop/length) or aborted; blocks released


class Tokens(abc.Sequence):
    """A sequence's prompt then its outputs, read in place: len(), items and slices of the two lists as one."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, part):  # an int -> its token; a slice -> a list
        cut = len(self.prompt)
        if not isinstance(part, slice):
            index = part + len(self) if part < 0 else part
            return self.prompt[index] if index < cut else self.output[index - cut]
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise ValueError("Tokens are sliced with step 1")
        if start >= cut:
            return self.output[start - cut:stop - cut]
        if stop <= cut:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.output[:stop - cut]


@dataclass(eq=False)
class Sequence:
    seq_id: int  # unique within the engine
    index: int  # choice index within its request (n > 1)
    prompt_ids: list[int]  # the prompt, never changed
    params: Any  # SamplingParams
    namespace: tuple  # prefix-cache identity: (weights id, adapter, tenant)
    generator: torch.Generator  # this sequence's own RNG stream
    output_ids: list[int] = field(default_factory=list)  # sampled tokens, in order
    num_computed_tokens: int = 0  # tokens whose KV is written (known tokens = prompt + output)
    block_table: Any = None  # BlockTable, owned through the BlockManager
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first allocation)
    num_preemptions: int = 0
    arrival: float = 0.0  # admission time (FCFS order)
    output: Any = None  # streaming text state (detokenizer + stop matcher), owned by the stage
    unsent: list[int] = field(default_factory=list)  # sampled tokens whose text no delta has carried yet
    stream_interval: int = 1  # the tokens one of its deltas carries at most
    logprobs: list = field(default_factory=list)  # per output token, when asked
    media: tuple = ()  # MediaSpans with features: spliced into the prompt's embeddings at every (re)prefill
    mrope: Any = None  # MRoPE positions of the prompt (Qwen2-VL-style models), else None
    hidden: list | None = None  # kept last hidden states, one per computed token (GenerationRequest.keep_hidden)
    hidden_sent: int = 0  # of those, the ones its deltas have carried
    matcher: Any = None  # its grammar's matcher (params.response_format; stages/llm/grammar.py), fed every token
    lora: tuple = ()  # LoRA adapters and weights of its tokens (stages/lora.py); they are in `namespace` too
    tenant: str = ""  # whose request: waiting sequences are admitted with the tenants in turns

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def tokens(self) -> Tokens:
        """token_ids without the copy: what a decode step's bookkeeping reads (its length and a slice or two)."""
        return Tokens(self.prompt_ids, self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
