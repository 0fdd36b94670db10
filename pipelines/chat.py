"""Chat and completion requests for causal LMs: validation, chat templates, the llm stage behind them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipelines.adapters import Adapters
from pipelines.chat_parts import checked_message
from pipelines.image_request import RequestError
from pipelines.token_bound import max_chars_per_token
from pipelines.token_texts import TokenTexts
from pipelines.tools import Tools, checked_calls
from stages.cuda_graph_metrics import MetricsObserver
from stages.cuda_graphs import GraphConfig
from stages.llm.params import SamplingParams
from stages.llm.runner import ModelRunner
from stages.llm.scheduler import SchedulerConfig
from stages.llm.stage import GenerationRequest, LLMStage
from stages.lora import LoraSlots
from stages.metrics import Metrics

if TYPE_CHECKING:
    from pipelines.config import LoraSpec

LLM_FAMILY = "causal-lm"


@dataclass
class ChatRequest:
    """A chat (messages) or completion (prompt) request, parsed but not yet tokenized."""

    messages: list[dict[str, Any]] | None = None  # OpenAI chat messages
    prompt: str | list[int] | None = None  # completions: text or token ids
    # completions with a list of prompts (text or token ids each): they run together, errors name prompt[i]
    prompts: list[str | list[int]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"  # enters the prefix-cache namespace
    speech: Any = None  # pipelines.omni.SpeechOutput: the reply spoken too (a model with a talker); None: text only
    # LoRA adapters of the model (`[[models.loras]]`, or the model id "base:adapter") and their weights
    lora: tuple[tuple[str, float | None], ...] = ()
    tools: Any = None  # pipelines.tools.Tools: the functions the model may call (chat only); None: no tools
    stream: bool = True  # the caller reads the text deltas as they come; False: only the result (GenerationRequest)


@dataclass(frozen=True)
class LLMConfig:
    kv_cache_mb: float = 256  # paged KV budget; the block count is derived from it at load
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 2048  # tokens in one forward (chunked prefill + decodes)
    max_prefill_chunk: int | None = None  # cap on one sequence's prefill chunk
    publish_thread: bool | None = None  # deltas published by a thread beside the forward; None: on a GPU only
    # tokens a streamed delta carries at most (vLLM's and SGLang's --stream-interval): the first token goes at once,
    # the rest in deltas of this many; fewer deltas cost the step less (detokenizing, events)
    stream_interval: int = 1

    def __post_init__(self):
        if self.kv_cache_mb <= 0 or self.block_size < 1:
            raise ValueError("llm.kv_cache_mb must be > 0 and llm.block_size >= 1")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_chunk)  # validates
        if not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool) or \
                self.stream_interval < 1:
            raise ValueError(f"llm.stream_interval must be an integer >= 1, got {self.stream_interval!r}")


class LanguageModel:
    """What every served language model shares once loaded (a text LM, a VLM): its tokenizer, the runner with its
    paged KV, the llm stage, and the checks and tokenizing of a request. Subclasses load; `_chat_ids` renders."""

    def __init__(self, name: str, tokenizer, runner: ModelRunner, weights_id: str, config: LLMConfig,
                 metrics: Metrics):
        self.name = name
        self.tokenizer = tokenizer
        self.runner = runner
        self.weights_id = weights_id
        self.max_chars_per_token = max_chars_per_token(tokenizer)  # None: no refusal before tokenizing
        self._tokenized_chars = metrics.llm.tokenized_chars.labels(model=name)
        self.stage = self._llm_stage(config, metrics)
        self.loras = Adapters(name, self.load_adapter, self.unload_adapter)  # PEFT LoRAs a request may name
        runner.adapters = self.loras  # every forward holds its gate
        self.slots: LoraSlots | None = None  # load_loras(slots=...): adapters inside the decode graphs

    def load_loras(self, loras: tuple[LoraSpec, ...], *, budget_bytes: int | None = None, dirs=(),
                   slots: LoraSlots | None = None) -> None:
        """The model's declared adapters, its budget of resident adapter bytes and its run-time lora_dirs; with
        `slots` (max_lora_rank), adapters live in slots the decode graphs read, so LoRA decode steps replay them."""
        self.loras.budget_bytes, self.loras.dirs = budget_bytes, tuple(dirs)
        if slots is not None:
            self.slots = slots
            self.runner.enable_lora_slots(slots)
            self.loras.max_resident = slots.count
        for spec in loras:
            self.loras.add(spec)

    def load_adapter(self, spec: LoraSpec) -> int:
        """Load one PEFT LoRA adapter (a directory with adapter_config.json and adapter_model.safetensors) into the
        runner's model beside the others, then have its LoRA layers apply adapters per token (stages/lora.py): the
        base weights stay as they are. An adapter of another model fails here, naming it. Returns its bytes. (The
        Adapters registry calls it, holding the gate alone.)"""
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        from stages.lora import adapter_bytes, mix_lora_layers

        model = self.runner.model
        layers = _lora_layers(model)
        try:
            config = LoraConfig.from_pretrained(spec.path)
            if any(m in (config.target_modules or ()) for m in ("lm_head", "embed_tokens")) \
                    or config.modules_to_save:
                raise ValueError("only the decoder's linear layers may be adapted (not lm_head, embeddings or "
                                 "modules_to_save)")
            state = load_file(f"{spec.path}/adapter_model.safetensors")
            state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
            inject_adapter_in_model(config, model, adapter_name=spec.name)
            unexpected = getattr(set_peft_model_state_dict(model, state, adapter_name=spec.name),
                                 "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"keys that are not in this model: {unexpected[:3]}")
            mix_lora_layers(model)
            if self.slots is not None:
                self.slots.check(model, spec.name)
                graphs = self.runner.decode_graphs
                if graphs is not None and graphs.sealed and _lora_layers(model) > layers:
                    raise ValueError("it adapts layers that no adapter declared at start did, so the captured "
                                     "decode graphs do not have them; declare such an adapter in the config")
                self.slots.put(model, spec.name)
        except Exception as exc:  # PEFT, safetensors and shape mismatches raise many kinds
            self.unload_adapter(spec.name)  # what a partial load injected
            raise ValueError(f"model {self.name}: lora {spec.name} ({spec.path}) does not load: "
                             f"{type(exc).__name__}: {exc}") from exc
        return adapter_bytes(model, spec.name)

    def unload_adapter(self, name: str) -> None:
        from peft.tuners.lora import LoraLayer

        from stages.lora import mix_lora_layers

        model = self.runner.model
        if self.slots is not None:
            self.slots.drop(model, name)
        for module in model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                module.delete_adapter(name)
        getattr(model, "peft_config", {}).pop(name, None)
        mix_lora_layers(model)  # PEFT activates a remaining adapter: off again

    def _llm_stage(self, config: LLMConfig, metrics: Metrics) -> LLMStage:
        """The llm stage over self.runner, stopping at the model's and the tokenizer's EOS tokens."""
        eos = self.runner.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        scheduler = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_chunk)
        return LLMStage(self.name, self.runner, self.tokenizer, scheduler, metrics, tuple(set(eos)),
                        publish_thread=config.publish_thread, stream_interval=config.stream_interval)

    def check_params(self, request: ChatRequest) -> None:
        """The sampling parameters against this model (token ids and top_k within its vocabulary; a
        response_format compiled over its tokenizer, once per grammar)."""
        try:
            request.params.check_vocab(self.runner.vocab_size)
        except ValueError as e:
            raise RequestError(str(e).split(" ")[0].strip(":"), str(e)) from None
        if request.params.response_format is not None:
            try:
                self.stage.grammars.compile(request.params.response_format)
            except ValueError as e:
                raise RequestError("response_format", str(e)) from None

    def token_texts(self) -> TokenTexts:
        """Token id -> (text, bytes) with this model's tokenizer, memoized: one per reply's logprobs."""
        return TokenTexts(self.tokenizer)

    def generation_request(self, request: ChatRequest) -> GenerationRequest:
        """Cheap checks, then the chat template and tokenizer: the token ids that will run."""
        request = self._with_tools(request)
        self.check_params(request)
        if sum(x is not None for x in (request.messages, request.prompt, request.prompts)) != 1:
            raise RequestError("messages", "send either messages (chat) or prompt (completions)")
        if request.messages is not None:
            prompts = [self._checked_ids(self._chat_ids(request.messages, request.tools), "messages")]
        elif request.prompt is not None:
            prompts = [self._checked_ids(self._completion_ids(request.prompt, "prompt"), "prompt")]
        else:
            if not request.prompts:
                raise RequestError("prompt", "the list of prompts is empty")
            for i, p in enumerate(request.prompts):  # every length first: a far too long one costs no tokenizing
                if isinstance(p, str):
                    self._check_chars(p, f"prompt[{i}]")
            prompts = [self._checked_ids(self._completion_ids(p, f"prompt[{i}]"), f"prompt[{i}]")
                       for i, p in enumerate(request.prompts)]
        lora = self.loras.resolve(request.lora)
        return GenerationRequest(prompts[0], request.params,
                                 (self.weights_id, self.loras.identity(lora) or None, request.tenant),
                                 more_prompts=tuple(prompts[1:]), keep_hidden=request.speech is not None, lora=lora,
                                 stream=request.stream)

    def _checked_ids(self, ids: list[int], param: str) -> tuple[int, ...]:
        if not ids:
            raise RequestError(param, "the prompt is empty")
        limit = self.runner.max_context
        if len(ids) >= limit:
            raise RequestError(param, f"the prompt is {len(ids)} tokens; this model's context is {limit} tokens",
                               code="context_length_exceeded")
        return tuple(ids)

    def _completion_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            return self._tokenize(prompt, param, add_special_tokens=True)
        vocab = self.runner.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(param, f"token ids must be in [0, {vocab}); got {bad[:5]}")
        return list(prompt)

    def _chat_ids(self, raw_messages: list[Any], tools: Tools | None = None) -> list[int]:
        raise NotImplementedError

    @property
    def tool_format(self):
        """The tool-call format of this model's chat template (pipelines/tool_formats), or None."""
        from pipelines.tool_formats import format_of

        return format_of(self.tokenizer.chat_template)

    def _with_tools(self, request: ChatRequest) -> ChatRequest:
        """A forced tool call (required, or a named function) becomes its grammar; `auto` needs a template that
        speaks a tool format."""
        tools = request.tools
        if tools is None:
            return request
        if request.messages is None:
            raise RequestError("tools", "tools are for chat messages, not completions")
        if tools.choice == "auto" and self.tool_format is None:
            raise RequestError("tools", f"model {self.name}'s chat template renders no tool calls, so tool_choice "
                               "auto cannot be read back; use tool_choice required or a named function")
        if not tools.forced:
            return request
        if request.params.response_format is not None:
            raise RequestError("response_format", "response_format cannot be combined with a forced tool call "
                               "(tool_choice required or a named function): the call has its own grammar")
        params = dataclasses.replace(request.params, response_format=tools.grammar())
        return dataclasses.replace(request, params=params)

    def _tokenize(self, text: str, param: str, *, add_special_tokens: bool) -> list[int]:
        """The token ids of `text`; refused unread when its characters alone cannot fit the context."""
        self._check_chars(text, param)
        self._tokenized_chars.inc(len(text))
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _check_chars(self, text: str, param: str) -> None:
        bound, limit = self.max_chars_per_token, self.runner.max_context
        if bound is not None and len(text) >= limit * bound:  # >= limit tokens, whatever the text says
            raise RequestError(param, f"the prompt is {len(text)} characters, so at least {-(-len(text) // bound)} "
                               f"tokens (no token of this model covers more than {bound} characters); this model's "
                               f"context is {limit} tokens", code="context_length_exceeded")


class ChatModel(LanguageModel):
    """A loaded causal LM: tokenizer + chat template, runner with its paged KV, and the llm stage."""

    def __init__(self, name: str, path: str, *, device: str, dtype: str, config: LLMConfig, metrics: Metrics,
                 graphs: GraphConfig = GraphConfig(), fused_kernels: bool = False):
        """`graphs`: decode row buckets (captured by `capture_graphs` at warm-up); `fused_kernels`: Triton RMSNorm."""
        from transformers import AutoTokenizer

        runner = ModelRunner(path, device=device, dtype=dtype, block_size=config.block_size,
                             kv_cache_mb=config.kv_cache_mb, graphs=graphs, name=name,
                             observer=MetricsObserver(metrics, "llm", name) if graphs.enabled else None)
        if fused_kernels:
            from stages.kernels.patch import use_fused_norms

            use_fused_norms(runner.model)
        super().__init__(name, AutoTokenizer.from_pretrained(path), runner, f"{LLM_FAMILY}:{path}", config, metrics)

    def _chat_ids(self, raw_messages: list[Any], tools: Tools | None = None) -> list[int]:
        messages = [_checked_message(m, i) for i, m in enumerate(raw_messages)]
        if not messages:
            raise RequestError("messages", "messages must hold at least one message")
        checked_calls(messages, raw_messages)
        if not self.tokenizer.chat_template:
            raise RequestError("messages", f"model {self.name} has no chat template; use /v1/completions")
        # Rendered, then tokenized as apply_chat_template(tokenize=True) does, so the length is checked in between.
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  tools=None if tools is None else tools.template_tools())
        assert isinstance(text, str)  # tokenize=False: the rendered text of one conversation
        return self._tokenize(text, "messages", add_special_tokens=False)


def _checked_message(message: Any, i: int) -> dict[str, Any]:
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


def _lora_layers(model) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in model.modules())
