"""DirectDecoder: a Llama-shaped decoder's layers run straight to the paged attention, its own modules called.

transformers' decoder forward wraps each step in machinery a paged engine does not use: per layer the decoder
layer's and attention module's keyword plumbing, the attention-interface lookup and the [1, heads, tokens, dim]
transposes in and out of it, and per forward the causal-mask builder and the output records. On a CPU, for a
small model, that is a measurable share of a decode step (the demo Llama, 16 rows: 1.3 ms of 7.3, measured against
the same layers written out). This forward calls the same modules (embeddings, norms, projections, rotary
embedding, MLP: so LoRA and quantized layers work unchanged) and transformers' own `apply_rotary_pos_emb`, in the
same order on the same values, so its hidden states equal the decoder's bit for bit (tests/test_llm_direct.py).

It serves the model types whose layers are exactly Llama's (Mistral's and Qwen2's add a sliding window, Qwen3's a
norm of q and k per head); any other decoder runs through transformers' forward.
"""

from __future__ import annotations

import sys

import torch

from stages.llm import attention

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class DirectDecoder:
    def __init__(self, decoder):
        self.decoder = decoder
        config = decoder.config
        self.layers = list(decoder.layers[:config.num_hidden_layers])
        first = self.layers[0].self_attn
        self.rotate = sys.modules[type(first).__module__].apply_rotary_pos_emb
        # each layer's (attention module, sliding window, q/k norms or None)
        self.attention = []
        for layer in self.layers:
            attn = layer.self_attn
            window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window",
                                                                                         None)
            self.attention.append((attn, window, getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)))

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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: attention.PagedMetadata) -> torch.Tensor:
        """input_ids, positions [T] (the packed step) -> the last hidden states [T, H]."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)  # [T, H]
        cos, sin = decoder.rotary_emb(hidden[None], positions[None])  # [1, T, D]
        cos, sin = cos[0], sin[0]
        tokens = hidden.shape[0]
        for layer, (attn, window, q_norm, k_norm) in zip(self.layers, self.attention):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (tokens, -1, attn.head_dim)
            q = attn.q_proj(hidden).view(shape)  # [T, heads, D]
            k = attn.k_proj(hidden).view(shape)
            v = attn.v_proj(hidden).view(shape)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = self.rotate(q, k, cos, sin, unsqueeze_dim=1)
            out = attention.paged_attention(attn.layer_idx, q, k, v, meta, attn.scaling, window)
            hidden = residual + attn.o_proj(out.reshape(tokens, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return decoder.norm(hidden)
