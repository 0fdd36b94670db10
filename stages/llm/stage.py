"""The llm stage: continuous batching as a LoopStage. Each pool step is one engine iteration.

Plan (scheduler) -> run (runner, one packed forward) -> commit (sample, stream, stop, release).
Every sequence of every admitted request takes part in the scheduler's plan; the pool's loop
only carries the items (requests) in and out at step boundaries, where a cancelled request's
blocks are released (no forward is in flight between steps: release after completion).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from stages.events import ErrorKind, EventKind, StageError
from stages.fair_queue import tenant_of
from stages.llm.blocks import BlockManager, BlockTable
from stages.llm.detokenizer import OutputText
from stages.llm.grammar import Constraint, Grammars
from stages.llm.multimodal import MediaSpan, MRoPE, attach_features, in_span_order
from stages.llm.params import SamplingParams
from stages.llm.runner import ModelRunner
from stages.llm.sampling import make_generator, sample
from stages.llm.scheduler import Plan, Scheduler, SchedulerConfig
from stages.llm.sequence import SeqStatus, Sequence
from stages.metrics import Metrics
from stages.placement import Affinity
from stages.stage import LoopStage, WorkItem


@dataclass(frozen=True)
class GenerationRequest:
    """What the llm stage runs: token ids and sampling, already validated.

    A completions request with a list of prompts is one GenerationRequest: every prompt starts in the
    same step (they share forwards), each with `params.n` choices; prompt k's choice j has index k * n + j.
    """

    prompt_ids: tuple[int, ...]  # the rendered, tokenized prompt (media placeholders expanded); the first of a list
    params: SamplingParams
    # Prefix-cache identity beyond the tokens: (weights id, adapter, tenant[, media identities]). Tokens
    # after a media span depend on the media, so a prompt with media carries every media identity.
    namespace: tuple
    media: tuple[MediaSpan, ...] = ()  # placeholder spans; features arrive from vision_encode / audio_encode
    mrope: MRoPE | None = None  # 3-D prompt positions for M-RoPE models
    more_prompts: tuple[tuple[int, ...], ...] = ()  # a list of prompts: the ones after prompt_ids (text only)
    # A speech decoder reads the model's last hidden state at every prompt token and every fed reply token
    # (Qwen2.5-Omni's talker): the sequence keeps them, and `finish` hands them on as choices[0]["hidden"].
    keep_hidden: bool = False
    lora: tuple = ()  # LoRA adapters and weights ((name, weight), ...) every token of the request runs with
    # the caller reads the deltas as they come (in deltas of the stage's stream_interval); False: only the result
    # (the first token's delta at once for its time to first token, the rest in one delta at the end)
    stream: bool = True

    def __post_init__(self):
        if self.more_prompts and (self.media or self.mrope is not None):
            raise ValueError("a list of prompts is text only (no media, no M-RoPE positions)")
        if self.keep_hidden and (self.more_prompts or self.params.n != 1):
            raise ValueError("keep_hidden is for one prompt and one choice")

    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        return (self.prompt_ids, *self.more_prompts)


log = logging.getLogger(__name__)


class _Publisher:
    """The llm loop's deltas, published in order: in the step (`threaded` False), or by a thread of their own, so
    the detokenizer and the events run beside the next step's forward while the device computes. On 2 CPU cores
    the thread measured no faster (2,160 against 2,216 tokens/s, 16 requests, medians of 6): the cores are busy
    with the forward either way. So it is for GPUs, where the host idles during a forward."""

    def __init__(self, model: str, threaded: bool):
        self._jobs: queue.SimpleQueue | None = None
        if threaded:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._run, name=f"{model}-llm-publish", daemon=True).start()

    def put(self, job: Callable[[], None]) -> None:
        if self._jobs is None:
            job()
        else:
            self._jobs.put(job)

    def drain(self) -> None:
        """Return once everything put before has been published."""
        if self._jobs is None:
            return
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    def _run(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # one delta's failure must not stop the others'
                log.exception("publishing an llm delta failed")


class LLMStage(LoopStage):
    kind = "llm"

    def __init__(self, model: str, runner: ModelRunner, tokenizer, scheduler: SchedulerConfig, metrics: Metrics,
                 eos_token_ids: tuple[int, ...], publish_thread: bool | None = None, stream_interval: int = 1):
        """`publish_thread`: publish deltas from a thread of their own (`_Publisher`); None: on a GPU only.
        `stream_interval`: the tokens one delta carries at most (LLMConfig.stream_interval)."""
        self.model = model
        self.runner = runner
        self.tokenizer = tokenizer
        self.blocks = BlockManager(runner.num_blocks, runner.kv.block_size)
        self.scheduler = Scheduler(self.blocks, scheduler)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.metrics = metrics
        m = metrics.llm  # the series this model's steps write, looked up once (the step is hot)
        self._ttft, self._itl = m.ttft.labels(model=model), m.itl.labels(model=model)
        self._forward_seqs, self._tokens = m.forward_seqs.labels(model=model), m.tokens.labels(model=model)
        self._gauges = (m.running.labels(model=model), m.waiting.labels(model=model),
                        *(m.blocks.labels(model=model, state=state) for state in ("free", "used", "cached")),
                        m.prefix_hit_tokens.labels(model=model), m.preemptions.labels(model=model))
        self._ids = itertools.count()
        self._owner: dict[int, WorkItem] = {}  # seq id -> its request's item
        self._grammars: Grammars | None = None  # made at the first constrained request
        threaded = runner.device.type == "cuda" if publish_thread is None else publish_thread
        self._publisher = _Publisher(model, threaded)
        self.stream_interval = stream_interval

    @property
    def grammars(self) -> Grammars:
        """This model's grammar compiler (stages/llm/grammar.py): its tokenizer over the logits' width, its EOS."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def batch_key(self, item: WorkItem) -> Hashable:
        return "llm"  # one scheduler decides; every active item is in the step

    def affinity(self, item: WorkItem) -> Affinity | None:
        """Prefix-affine routing across replicas: a prompt whose first KV block (and namespace: weights, tenant,
        media) another request had goes where that block is cached. Shorter prompts cache nothing: least loaded."""
        req: GenerationRequest = item.inputs["request"]
        size = self.runner.kv.block_size
        if len(req.prompt_ids) < size:
            return None
        return Affinity(("prefix", req.namespace, req.prompt_ids[:size]), sticky=False)

    # -- requests in and out --------------------------------------------------------------------
    def start(self, item: WorkItem) -> None:
        req: GenerationRequest = item.inputs["request"]
        features = in_span_order(req.media, item.inputs.get("features"), item.inputs.get("audio_features"))
        if req.media or features:
            media = attach_features(req.media, features, num_tokens=len(req.prompt_ids),
                                    hidden_size=self.runner.hidden_size)
            req = dataclasses.replace(req, media=media)
        for prompt in req.prompts:  # every prompt is checked before any enters the scheduler
            if len(prompt) >= self.runner.max_context:
                raise StageError("context_length_exceeded", f"the prompt is {len(prompt)} tokens; this model's "
                                 f"context is {self.runner.max_context}", param="messages", kind=ErrorKind.INVALID)
            try:
                self.scheduler.check_fits(len(prompt) + 1)
            except ValueError as e:
                raise StageError("context_length_exceeded", str(e), param="messages", kind=ErrorKind.INVALID) from None
        n = req.params.n
        seqs = [self._new_seq(req, prompt, index=k * n, generator=make_generator(req.params.seed),
                              tenant=tenant_of(item))
                for k, prompt in enumerate(req.prompts)]  # the same seed per prompt: as if each came alone
        for seq in seqs:
            self.scheduler.add(seq)
            self._owner[seq.seq_id] = item
        # n > 1: each prompt's first sequence forks its siblings once its prompt is prefilled
        unforked = {seq.seq_id for seq in seqs} if n > 1 else set()
        item.state.update(request=req, seqs=seqs, unforked=unforked, started=time.monotonic(), first=None, last=None)

    def abort(self, item: WorkItem) -> None:
        for seq in item.state.get("seqs", ()):
            self._finish_seq(seq, "abort")
        self._observe()

    def is_done(self, item: WorkItem) -> bool:
        return not item.state["unforked"] and all(s.finished for s in item.state["seqs"])

    def finish(self, item: WorkItem) -> dict[str, Any]:
        self._publisher.drain()  # every delta out, every text complete
        seqs = sorted(item.state["seqs"], key=lambda s: s.index)
        n = item.inputs["request"].params.n
        firsts = [s for s in seqs if s.index % n == 0]  # one per prompt: its cached count is the prompt's
        choices = [{"index": s.index, "text": s.output.text, "token_ids": list(s.output_ids),
                    "finish_reason": s.finish_reason, "logprobs": s.logprobs or None} for s in seqs]
        for choice, s in zip(choices, seqs):
            if s.hidden is not None:  # [prompt + fed reply tokens, H]: the last sampled token was never fed
                choice["hidden"] = torch.stack(s.hidden)
        usage = {"prompt_tokens": sum(len(s.prompt_ids) for s in firsts),
                 "completion_tokens": sum(len(s.output_ids) for s in seqs),
                 "cached_tokens": sum(s.num_cached_tokens for s in firsts)}
        if item.trace is not None:
            item.trace.cached_tokens = usage["cached_tokens"]
        return {"choices": choices, "usage": usage}

    # -- one engine iteration -----------------------------------------------------------------
    def step(self, items: list[WorkItem]) -> None:
        if self._continue_decode():
            return
        plan = self.scheduler.schedule()  # 1. plan (the launch record)
        if not plan.chunks:
            self._observe()
            return
        logits = self.runner.execute(plan)  # 2. run
        self._forward_seqs.observe(len(plan.chunks))
        self.scheduler.commit(plan)  # 3. commit: KV of the plan's chunks is written
        self._sample_and_publish(plan, logits)
        self._observe()

    def _continue_decode(self) -> bool:
        """The common CPU decode step, the running sequences each one token further, run without a Plan: the
        scheduler assigns their slots (in place, or in a new block), the runner attends from its mirror without
        block tables or a layout, and the rows are sampled and published as any step's. The same tokens and
        log-probabilities as the planned step (tests/test_llm_engine.py); the host's share of a step of 16 rows of
        the demo Llama 1.18 -> 0.99 ms (of 12), measured. False where the planned step must run: someone waits, a
        copy-on-write, a preemption, the mirror rebuilt, adapters, media, kept hidden states, a sliding window, a
        GPU."""
        if not self.runner.plan_free:
            return False
        seqs = self.scheduler.decoding()  # (n > 1: a parent forks at its first token, sampled by a planned step)
        if seqs is None or not self.runner.continues(seqs):
            return False
        logits = self.runner.continue_decode(seqs, self.scheduler.append_slots(seqs))
        self._forward_seqs.observe(len(seqs))
        self.scheduler.commit_decode(seqs)
        self._sample_rows(seqs, logits)
        self._observe()
        return True

    def _sample_and_publish(self, plan: Plan, logits: torch.Tensor) -> None:
        rows: list[Sequence] = []
        row_logits: list[int] = []
        for i, chunk in enumerate(c for c in plan.chunks if c.sample):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # cancelled or finished since launch: its row is dropped
            rows.append(seq)
            row_logits.append(i)
            item = self._owner[seq.seq_id]
            if seq.seq_id in item.state["unforked"]:
                rows += self._fork_children(item, seq)  # n > 1: siblings share the prompt's blocks
                row_logits += [i] * (len(rows) - len(row_logits))
        if not rows:
            return
        if row_logits != list(range(logits.shape[0])):  # some rows dropped or forked: their logits picked
            logits = logits[row_logits]
        self._sample_rows(rows, logits)

    def _sample_rows(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (`logits[r]` is row r's), appended and published."""
        constrained = [r for r, seq in enumerate(rows) if seq.matcher is not None]
        constraint = None
        if constrained:
            constraint = Constraint(self.grammars, constrained, [rows[r].matcher for r in constrained],
                                    [rows[r].params.response_format.kind.startswith("json") for r in constrained])
        out = sample(logits, [s.params for s in rows], [s.prompt_ids for s in rows],
                     [s.output_ids for s in rows], [s.generator for s in rows], constraint)
        now = time.monotonic()
        for r, seq in enumerate(rows):
            item = self._owner[seq.seq_id]
            if r in out.errors:
                self._fail_request(item, out.errors[r])
                continue
            if item.state["first"] is None:
                item.state["first"] = now
                self._ttft.observe(now - item.state["started"])
            elif item.state["last"] != now:
                self._itl.observe(now - item.state["last"])
            item.state["last"] = now
            self._append(item, seq, out.token_ids[r], out.logprobs[r], out.top_logprobs[r])
        self._tokens.inc(len(rows))

    def _append(self, item: WorkItem, seq: Sequence, token: int, logprob, top) -> None:
        """The sampled token joins the sequence; whether it ends it is decided here, its text and delta are made
        by the publisher (`_Publisher`) unless stop strings need the text now."""
        p = seq.params
        ended = token in self.eos_token_ids and not p.ignore_eos or token in p.stop_token_ids
        if seq.matcher is not None:  # the grammar takes the token (its mask allowed only such tokens)
            seq.matcher.accept_token(token)
            ended = ended or seq.matcher.is_terminated()  # complete: its end token ends it, whatever ignore_eos says
        seq.output_ids.append(token)
        if ended:  # the end token's text is not part of the output
            self._publish(item, seq, "stop")
            return
        entry = None
        if p.logprobs:
            entry = {"token_id": token, "logprob": logprob, "top_logprobs": top}
            seq.logprobs.append(entry)
        full = (p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens) or \
            seq.num_tokens >= self.runner.max_context
        if not p.stop:  # the token waits for its delta unless it is the first, the last, or carries per-token data
            seq.unsent.append(token)
            if full or len(seq.unsent) >= seq.stream_interval or len(seq.output_ids) == 1 or entry is not None or \
                    seq.hidden is not None:
                self._publish(item, seq, "length" if full else None, entry)
            return
        delta = seq.output.push(token)  # stop strings: the text decides whether it ends, so it is made now
        if delta.stopped:
            self._publish(item, seq, "stop", entry, text=delta.text)
        elif full:
            final = seq.output.finish()  # a held stop string may still settle here
            self._publish(item, seq, "stop" if final.stopped else "length", entry, text=delta.text + final.text)
        else:
            self._publish(item, seq, None, entry, text=delta.text)

    def _publish(self, item: WorkItem, seq: Sequence, finish_reason: str | None, logprobs=None,
                 text: str | None = None) -> None:
        """Stream one delta: the text of the sequence's unsent tokens (or `text` when it was made already) and, when
        the sequence ends, what the detokenizer still held; `logprobs` is the entry of the token sampled now, if it
        was asked for. The sequence's end is recorded now; the text is made and the delta emitted by the publisher,
        in order."""
        tokens, seq.unsent = seq.unsent, []
        if finish_reason is not None:
            self._finish_seq(seq, finish_reason)
        data: dict[str, Any] = {"index": seq.index, "finish_reason": finish_reason}
        if logprobs is not None:
            data["logprobs"] = logprobs
        if seq.hidden is not None:  # a speech decoder reads the reply as it is written (pipelines/omni_talker.py)
            if not seq.hidden_sent:
                data["prompt_ids"] = list(seq.prompt_ids)
            data["token_id"] = seq.output_ids[-1]
            data["hidden"] = torch.stack(seq.hidden[seq.hidden_sent:]) if len(seq.hidden) > seq.hidden_sent else \
                torch.zeros(0, self.runner.hidden_size)
            seq.hidden_sent = max(seq.hidden_sent, len(seq.hidden))

        def emit() -> None:
            made = text
            if made is None:
                made = seq.output.push_ids(tokens).text if tokens else ""
                if finish_reason is not None:
                    made += seq.output.finish().text
            item.emit(EventKind.DELTA, text=made, **data)

        self._publisher.put(emit)

    def _fail_request(self, item: WorkItem, message: str) -> None:
        for seq in item.state["seqs"]:
            self._finish_seq(seq, "abort")
        item.state["unforked"].clear()
        item.emit(EventKind.ERROR, code="sampling_failed", message=message, param=None,
                  error_kind=ErrorKind.INVALID.value)

    # -- sequences ----------------------------------------------------------------------------
    def _new_seq(self, req: GenerationRequest, prompt_ids: tuple[int, ...], index: int,
                 generator: torch.Generator, tenant: str) -> Sequence:
        seq_id = next(self._ids)
        # A sequence that keeps its hidden states computes every token: a namespace of its own, so no cached
        # prefix stands in for a prompt token whose state it needs.
        namespace = (*req.namespace, ("keep_hidden", seq_id)) if req.keep_hidden else req.namespace
        seq = Sequence(seq_id=seq_id, index=index, prompt_ids=list(prompt_ids), params=req.params,
                       namespace=namespace, generator=generator, arrival=time.monotonic(), media=req.media,
                       mrope=req.mrope, hidden=[] if req.keep_hidden else None, lora=req.lora, tenant=tenant,
                       stream_interval=self.stream_interval if req.stream else sys.maxsize)
        seq.output = OutputText(self.tokenizer, prompt_ids, req.params.stop)
        if req.params.response_format is not None:
            seq.matcher = self.grammars.matcher(req.params.response_format)
        return seq

    def _fork_children(self, item: WorkItem, parent: Sequence) -> list[Sequence]:
        """The n - 1 siblings of `parent` (choice parent.index + j), sharing its prompt's blocks."""
        req: GenerationRequest = item.state["request"]  # with its media features: a preempted child re-prefills
        item.state["unforked"].discard(parent.seq_id)
        children = []
        for j in range(1, req.params.n):
            seed = None if req.params.seed is None else req.params.seed + j  # one stream per choice
            child = self._new_seq(req, tuple(parent.prompt_ids), parent.index + j, make_generator(seed),
                                  tenant=parent.tenant)
            child.block_table = BlockTable(block_ids=[])
            self.blocks.fork(parent.block_table, child.block_table)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add_running(child)
            self._owner[child.seq_id] = item
            item.state["seqs"].append(child)
            children.append(child)
        return children

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._owner.pop(seq.seq_id, None)

    def usage(self) -> dict[str, int]:
        return {"kv_blocks_used": self.blocks.num_used_blocks, "kv_blocks_free": self.blocks.num_free_blocks,
                "sequences": len(self.scheduler.running) + len(self.scheduler.waiting)}

    def _observe(self) -> None:
        running, waiting, free, used, cached, hits, preemptions = self._gauges
        running.set(len(self.scheduler.running))
        waiting.set(len(self.scheduler.waiting))
        free.set(self.blocks.num_free_blocks - self.blocks.num_cached_blocks)
        used.set(self.blocks.num_used_blocks)
        cached.set(self.blocks.num_cached_blocks)
        hits.set(self.blocks.stats.hits)
        preemptions.set(self.scheduler.num_preemptions)
