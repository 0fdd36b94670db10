"""DirectDecoder: a Llama-shaped decoder's layers run straight to the paged attention, its own modules called.

transformers' decoder forward wraps each step in machinery a paged engine does not use: per layer the decoder
layer's and attention module's keyword plumbing, the attention-interface lookup and the [1, heads, tokens, dim]
transposes in and out of it, and per forward the causal-mask builder and the output records. On a CPU, for a
small model, that is a measurable share of a decode step (the demo Llama, 16 rows: 1.3 ms of 7.3, measured against
the same layers written out). This forward calls the same modules (embeddings, norms, projections, rotary
embedding, MLP: so LoRA and quantized layers work unchanged) and rotates as the model's `apply_rotary_pos_emb` does
(`Rotary`), in the same order on the same values, so its hidden states equal the decoder's bit for bit
(tests/test_llm_direct.py; a prefill's, which skips the last layer's rows that do not sample: to rounding).
Where a module is exactly the class it claims and bare (no hooks, no patched forward), the op its forward is runs
without the module call (linear layers, the MLP, torch's rms_norm for the norms): the same ops, less Python
(-2.4 % a round of 16 requests, alternated in one engine).

It serves the model types whose layers are exactly Llama's (Mistral's and Qwen2's add a sliding window, Qwen3's a
norm of q and k per head); any other decoder runs through transformers' forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _global_hooks

from stages.llm import attention

TABLE_POSITIONS = 1024  # the rotation's first table (positions); it doubles when a step reaches past it
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# weight * x * rsqrt(mean(x^2) + eps), in float32 the very ops of torch's rms_norm, which runs them in one call
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")  # down_proj(act_fn(gate_proj(x)) * up_proj(x))


def bare(module: Any) -> bool:
    """Calling `module` runs its class's forward and nothing else: no hooks (its own or global ones) and no
    forward patched onto the instance (stages/kernels/patch.py's Triton norms, accelerate's offload)."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                or _global_hooks._global_forward_hooks or _global_hooks._global_forward_pre_hooks)


def linear(module: Any, x: torch.Tensor) -> torch.Tensor:
    """module(x): a bare nn.Linear as the F.linear its forward is, without the module call's machinery (7 calls
    a layer); anything else (a PEFT LoRA wrapper, a quantized layer) is called. Decided at every call: adapters
    wrap layers after the decoder is built."""
    if type(module) is torch.nn.Linear and bare(module):
        return F.linear(x, module.weight, module.bias)
    return module(x)


def short_norm(module: Any, x: torch.Tensor) -> bool:
    """Whether torch's rms_norm gives `module(x)` bit for bit: one of RMS_NORMS, bare, on float32 (in bfloat16
    rms_norm rounds the weight's product apart)."""
    return x.dtype == torch.float32 and type(module).__name__ in RMS_NORMS and bare(module)


def norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """module(x), by torch's rms_norm where that is the same (~30 % faster: 2 a layer)."""
    if short_norm(module, x):
        return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)
    return module(x)


def short_mlp(module: Any) -> bool:
    """Whether `module` is one of MLPS with SiLU, bare: then `mlp` spells out its forward."""
    act = getattr(module, "act_fn", None)
    return type(module).__name__ in MLPS and bare(module) and type(act).__name__ == "SiLUActivation" and \
        bare(act)


def mlp(module: Any, x: torch.Tensor) -> torch.Tensor:
    if short_mlp(module):  # in place on the gate's fresh product: the same values, two products' memory less
        gated = F.silu(linear(module.gate_proj, x), inplace=True).mul_(linear(module.up_proj, x))
        return linear(module.down_proj, gated)
    return module(x)


class Rotary:
    """transformers' apply_rotary_pos_emb (x * cos + rotate_half(x) * sin) in 4 ops a tensor instead of 7:
    rotate_half(x) * sin = [-x2, x1] * [s1, s2] = [x2, x1] * [-s1, s2], a roll of x times a sine whose first half
    is negated once a step for every layer; negation is exact, so the result is the same bit for bit. Taken only
    where the model's own function gives that result on a probe (a model with another rotation keeps its own)."""

    def __init__(self, apply_rotary_pos_emb, dtype: torch.dtype):
        self.theirs = apply_rotary_pos_emb
        gen = torch.Generator().manual_seed(0)
        q, k, cos, sin = (torch.randn(3, heads, 8, generator=gen).to(dtype) for heads in (4, 2, 1, 1))
        ours = self.apply(q, k, *self.prepare(cos[:, 0], sin[:, 0]))
        theirs = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
        self.exact = all(torch.equal(a, b) for a, b in zip(ours, theirs))

    @staticmethod
    def prepare(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] -> [T, 1, D] each, the sine's first half negated (once a step)."""
        half = sin.shape[-1] // 2
        return cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        return Rotary.one(q, cos, signed_sin), Rotary.one(k, cos, signed_sin)

    @staticmethod
    def one(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class DirectDecoder:
    def __init__(self, decoder):
        self.decoder = decoder
        config = decoder.config
        self.layers = list(decoder.layers[:config.num_hidden_layers])
        first = self.layers[0].self_attn
        self.rotary = Rotary(sys.modules[type(first).__module__].apply_rotary_pos_emb, first.q_proj.weight.dtype)
        rope_type = str(getattr(decoder.rotary_emb, "rope_type", "default"))
        self.tabled = "dynamic" not in rope_type and rope_type != "longrope"  # (see _cos_sin)
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin by position (see _cos_sin)
        # each layer's (attention module, sliding window, whether it has q/k norms)
        self.attention = []
        for layer in self.layers:
            attn = layer.self_attn
            window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window",
                                                                                         None)
            self.attention.append((attn, window, hasattr(attn, "q_norm")))
        self.windowless = all(window is None for _, window, _ in self.attention)  # (no layer's keys end early)

    def _cos_sin(self, hidden: torch.Tensor, positions: torch.Tensor, longest: int | None):
        """The rotation's cos and sin at `positions` ([T, 1, D], the sine signed, where `Rotary` applies it; else
        [T, D] for the model's own function), read from a table of the model's own rotary embedding over positions
        0 .. n - 1, made once and grown when a step reaches past it (vLLM's cos_sin_cache): the same values as the
        embedding called each step, which computes each position alone, without its dozen ops a step. A rotation
        that depends on the sequence's length (dynamic, longrope) is computed each step."""
        rotary_emb = self.decoder.rotary_emb
        if not self.tabled:
            return self._shaped(*rotary_emb(hidden[None], positions[None]))
        longest = int(positions.max()) + 1 if longest is None else longest
        if self.table is None or longest > self.table[0].shape[0]:
            size = max(longest, 2 * self.table[0].shape[0] if self.table is not None else 0, TABLE_POSITIONS)
            everywhere = torch.arange(size, device=hidden.device)
            self.table = self._shaped(*rotary_emb(hidden[:1, None], everywhere[None]))
        return self.table[0][positions], self.table[1][positions]

    def _shaped(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding's cos, sin [1, T, D] in the form the rotation applied takes."""
        return self.rotary.prepare(cos[0], sin[0]) if self.rotary.exact else (cos[0], sin[0])

    @staticmethod
    def serves(decoder) -> bool:
        """Whether `decoder` (a causal LM's base model) has Llama's layers."""
        config = getattr(decoder, "config", None)
        layers = getattr(decoder, "layers", None)
        if config is None or layers is None or getattr(config, "model_type", None) not in MODEL_TYPES:
            return False
        needed = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
        return all(all(hasattr(layer, name) for name in needed) for layer in layers) and \
            all(hasattr(layer.self_attn, name) for layer in layers for name in ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj", "head_dim", "scaling"))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: attention.PagedMetadata,
                 sampled: tuple[torch.Tensor, attention.PagedMetadata] | None = None) -> torch.Tensor:
        """input_ids, positions [T] (the packed step) -> the last hidden states [T, H]; with `sampled` (the packed
        rows that sample, and their metadata as decode rows) only theirs, [S, H]: the last layer computes every
        row's key and value (the cache keeps them), and from its queries on it goes on with those rows alone
        (llama.cpp's output rows). Of a prefill only the last row samples: its other rows skip the queries, the
        attention, the output projection and the MLP of one layer (a quarter of the demo Llama's prefill less
        the keys and values). Those rows equal the full layer's to rounding, not bit for bit: a product of a
        few rows rounds apart from the same rows in a large one, and they attend as decode rows."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)  # [T, H]
        cos, sin = self._cos_sin(hidden, positions, meta.max_context_len)
        last = len(self.layers) - 1
        for i, (layer, (attn, window, qk_norms)) in enumerate(zip(self.layers, self.attention)):
            rows, tail = sampled if sampled is not None and i == last else (None, None)
            residual = hidden
            hidden = norm(layer.input_layernorm, hidden)
            k = linear(attn.k_proj, hidden).view(hidden.shape[0], -1, attn.head_dim)  # [T, kv heads, D]
            v = linear(attn.v_proj, hidden).view(k.shape)
            if rows is not None:  # the layer goes on with the rows that sample: the queries are theirs alone
                hidden, residual = hidden[rows], residual[rows]
            q = linear(attn.q_proj, hidden).view(hidden.shape[0], -1, attn.head_dim)  # [T or S, heads, D]
            if qk_norms:
                q, k = norm(attn.q_norm, q), norm(attn.k_norm, k)
            q, k = self._rotate(q, k, cos, sin, rows)
            out = attention.paged_attention(attn.layer_idx, q, k, v, meta, attn.scaling, window, sampled=tail)
            hidden = residual + linear(attn.o_proj, out.reshape(q.shape[0], -1))
            hidden = hidden + mlp(layer.mlp, norm(layer.post_attention_layernorm, hidden))
        return norm(decoder.norm, hidden)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k turned to their positions; `rows`: q holds only those rows of the step."""
        q_cos, q_sin = (cos, sin) if rows is None else (cos[rows], sin[rows])
        if self.rotary.exact:
            return Rotary.one(q, q_cos, q_sin), Rotary.one(k, cos, sin)
        if rows is None:
            return self.rotary.theirs(q, k, cos, sin, unsqueeze_dim=1)
        return (self.rotary.theirs(q, q, q_cos, q_sin, unsqueeze_dim=1)[0],
                self.rotary.theirs(k, k, cos, sin, unsqueeze_dim=1)[0])
