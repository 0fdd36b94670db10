"""Chat and completion requests for causal LMs: validation, chat templates, the llm stage behind them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelines.chat_parts import checked_message
from pipelines.request import RequestError
from stages.graph_metrics import MetricsObserver
from stages.graph_runner import GraphConfig
from stages.llm.params import SamplingParams
from stages.llm.runner import ModelRunner
from stages.llm.scheduler import SchedulerConfig
from stages.llm.stage import GenerationRequest, LLMStage
from stages.metrics import Metrics

LLM_FAMILY = "causal-lm"


@dataclass
class ChatRequest:
    """A chat (messages) or completion (prompt) request, parsed but not yet tokenized."""

    messages: list[dict[str, Any]] | None = None  # OpenAI chat messages
    prompt: str | list[int] | None = None  # completions: text or token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"  # enters the prefix-cache namespace


@dataclass(frozen=True)
class LLMConfig:
    kv_cache_mb: float = 256  # paged KV budget; the block count is derived from it at load
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 2048  # tokens in one forward (chunked prefill + decodes)
    max_prefill_chunk: int | None = None  # cap on one sequence's prefill chunk

    def __post_init__(self):
        if self.kv_cache_mb <= 0 or self.block_size < 1:
            raise ValueError("llm.kv_cache_mb must be > 0 and llm.block_size >= 1")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_chunk)  # validates


class ChatModel:
    """A loaded causal LM: tokenizer + chat template, runner with its paged KV, and the llm stage."""

    def __init__(self, name: str, path: str, *, device: str, dtype: str, config: LLMConfig, metrics: Metrics,
                 graphs: GraphConfig = GraphConfig(), fused_kernels: bool = False):
        """`graphs`: decode row buckets (captured by `capture_graphs` at warm-up); `fused_kernels`: Triton RMSNorm."""
        from transformers import AutoTokenizer

        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.runner = ModelRunner(path, device=device, dtype=dtype, block_size=config.block_size,
                                  kv_cache_mb=config.kv_cache_mb, graphs=graphs, name=name,
                                  observer=MetricsObserver(metrics, "llm", name) if graphs.enabled else None)
        if fused_kernels:
            from stages.kernels.patch import use_fused_norms

            use_fused_norms(self.runner.model)
        self.weights_id = f"{LLM_FAMILY}:{path}"
        self.stage = self._llm_stage(config, metrics)

    def _llm_stage(self, config: LLMConfig, metrics: Metrics) -> LLMStage:
        """The llm stage over self.runner, stopping at the model's and the tokenizer's EOS tokens."""
        eos = self.runner.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        scheduler = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_chunk)
        return LLMStage(self.name, self.runner, self.tokenizer, scheduler, metrics, tuple(set(eos)))

    def generation_request(self, request: ChatRequest) -> GenerationRequest:
        """Cheap checks, then the chat template and tokenizer: the token ids that will run."""
        try:
            request.params.check_vocab(self.runner.vocab_size)
        except ValueError as e:
            raise RequestError(str(e).split(" ")[0].strip(":"), str(e)) from None
        ids = self._prompt_ids(request)
        if not ids:
            raise RequestError("prompt" if request.messages is None else "messages", "the prompt is empty")
        limit = self.runner.max_context
        if len(ids) >= limit:
            raise RequestError("prompt" if request.messages is None else "messages",
                               f"the prompt is {len(ids)} tokens; this model's context is {limit} tokens",
                               code="context_length_exceeded")
        return GenerationRequest(tuple(ids), request.params, (self.weights_id, None, request.tenant))

    def _prompt_ids(self, request: ChatRequest) -> list[int]:
        if (request.messages is None) == (request.prompt is None):
            raise RequestError("messages", "send either messages (chat) or prompt (completions)")
        if request.prompt is not None:
            if isinstance(request.prompt, str):
                return self.tokenizer(request.prompt, add_special_tokens=True).input_ids
            vocab = self.runner.vocab_size
            bad = [t for t in request.prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestError("prompt", f"token ids must be in [0, {vocab}); got {bad[:5]}")
            return list(request.prompt)
        messages = [_checked_message(m, i) for i, m in enumerate(request.messages)]
        if not messages:
            raise RequestError("messages", "messages must hold at least one message")
        if not self.tokenizer.chat_template:
            raise RequestError("messages", f"model {self.name} has no chat template; use /v1/completions")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))


def _checked_message(message: Any, i: int) -> dict[str, str]:
    where, role, content = checked_message(message, i)
    if isinstance(content, list):  # content parts: text only for a text model
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}]", f"{where}.content[{j}] must be a text part "
                                   "({\"type\": \"text\", \"text\": ...}); this model reads text only")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    return {"role": role, "content": content}
