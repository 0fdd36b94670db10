"""ModelRunner: a transformers causal LM, its paged KV tensors, and one forward per Plan (execution only).

A vision-language model passes its already-loaded model, its language decoder and whether it uses
M-RoPE: the runner then embeds the prompt itself and splices the media features in (multimodal.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from stages.llm import attention
from stages.llm.multimodal import mrope_positions, splice
from stages.llm.scheduler import Plan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers: 2 * layers * block_size * Hkv * D * bytes."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class ModelRunner:
    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32", block_size: int = 16,
                 kv_cache_mb: float = 256, num_blocks: int | None = None, model=None, decoder=None,
                 mrope: bool = False):
        """`model`: an already-loaded model whose language part uses the paged attention (a VLM), with
        `decoder` its language model (embeddings in, hidden states out); `mrope`: 3-D positions."""
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype,
                                                         attn_implementation=attention.register())
            model.to(self.device).eval()
        self.model = model
        self.decoder = decoder if decoder is not None else getattr(model, model.base_model_prefix)
        self.mrope = mrope
        config = self.model.config.get_text_config()
        self.config = config
        heads = config.num_attention_heads
        self.kv = KVShape(num_layers=config.num_hidden_layers,
                          num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                          head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                          block_size=block_size, dtype=self.dtype)
        # Sized from the memory budget unless given: the block count is a start-up measurement.
        self.num_blocks = num_blocks or max(1, int(kv_cache_mb * 2**20) // self.kv.block_bytes)
        shape = (self.num_blocks, block_size, self.kv.num_kv_heads, self.kv.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.kv.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.kv.num_layers)]
        self.max_context = getattr(config, "max_position_embeddings", None) or 2048
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.hidden_size = config.hidden_size

    @torch.inference_mode()
    def execute(self, plan: Plan) -> torch.Tensor:
        """Run the plan's chunks as one packed forward; return float32 logits [rows that sample, V]."""
        for src, dst in plan.copies:  # copy-on-write of shared partial blocks, before anyone writes them
            for cache in (*self.k_caches, *self.v_caches):
                cache[dst].copy_(cache[src])
        chunks = plan.chunks
        dev = self.device
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=dev)
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.context_len)], dtype=torch.long,
                                 device=dev)
        lengths = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.long)
        max_blocks = max(len(c.block_ids) for c in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.long)
        meta = attention.PagedMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches,
            slot_mapping=torch.tensor([s for c in chunks for s in c.slots], dtype=torch.long, device=dev),
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(dev),
            context_lens=torch.tensor([c.context_len for c in chunks], dtype=torch.long, device=dev),
            block_tables=tables.to(dev), all_decode=bool((lengths == 1).all()))
        inputs = {"input_ids": input_ids[None]}
        if any(c.seq.media for c in chunks):  # embed, then splice each chunk's slice of its media features
            embeds = self.model.get_input_embeddings()(input_ids)  # [T, H]
            row = 0
            for c in chunks:
                splice(embeds, row, c.start, c.context_len, c.seq.media)
                row += len(c.token_ids)
            inputs = {"inputs_embeds": embeds[None]}
        if self.mrope:  # [3, 1, T]: temporal, height, width positions
            positions = torch.cat([mrope_positions(c.seq.mrope, c.start, c.context_len) for c in chunks],
                                  dim=1)[:, None].to(dev)
        else:
            positions = positions[None]
        hidden = self.decoder(**inputs, position_ids=positions, use_cache=False,
                              paged=meta).last_hidden_state[0]  # [T, H]
        last = torch.tensor([int(meta.query_start_loc[i + 1]) - 1 for i, c in enumerate(chunks) if c.sample],
                            dtype=torch.long, device=dev)
        logits = self.model.get_output_embeddings()(hidden[last]).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
