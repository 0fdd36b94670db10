"""Paged attention as a transformers attention implementation ("mmserve_paged").

The model runs with `config._attn_implementation = "mmserve_paged"`; each attention layer
calls `paged_attention_forward` with this step's (post-RoPE) query/key/value of the packed
batch. It writes the new K/V into the paged cache at the step's slots, then attends over each
sequence's cached context through its block table: the Triton decode kernel when every row is
a decode on the GPU, else the batched torch path (mixed prefill/decode, and the CPU): one masked SDPA
over every sequence's gathered context, no Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from stages.llm.decode_mirror import DecodeMirror
from stages.llm.paged_attention import (
    BatchedLayout,
    batched_layouts,
    decode_attention,
    gathered,
    paged_attention_batched,
    write_kv,
)

ATTN_IMPLEMENTATION = "mmserve_paged"


@dataclass
class PagedMetadata:
    """What every layer needs for one forward, built from the launch record (the Plan)."""

    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, D]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] physical slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] cumulative query lengths of the packed batch
    context_lens: torch.Tensor  # [B] cached tokens per sequence, this step's included
    block_tables: torch.Tensor  # [B, max_blocks]
    all_decode: bool  # every sequence feeds exactly one token
    slots_valid: bool = False  # no -1 slot: the KV write needs no filter (graph replay: padding uses a scratch slot)
    max_query_len: int | None = None  # the longest chunk of the step, known on the host (1: every row decodes)
    max_context_len: int | None = None  # the longest context of the step, known on the host
    mirror: DecodeMirror | None = None  # a CPU decode step's keys and values kept laid out across steps
    # per sliding window: built by the first layer that needs them, shared by the rest
    layouts: dict[int | None, tuple[BatchedLayout, ...]] = field(default_factory=dict)


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                            scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function form of `paged_attention`: q/k/v [1, heads, T, D] -> [1, T, Hq, D]."""
    out = paged_attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), kwargs["paged"], scaling, sliding_window, softcap)
    return out.unsqueeze(0), None


def paged_attention(layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: PagedMetadata,
                    scaling: float | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, sampled: PagedMetadata | None = None) -> torch.Tensor:
    """One layer's attention for the packed step: q [T, Hq, D], this step's key/value [T, Hkv, D] (written into
    the paged cache first, or into the mirror of a step it continues) -> [T, Hq, D].
    `sampled`: only the rows that sample go on past this layer (the last, of a prefill: `DirectDecoder`); q holds
    those rows [S, Hq, D], each the last of its chunk, and they attend as the decode rows `sampled` describes, after
    every row's key and value is written -> [S, Hq, D]."""
    mirror = meta.mirror
    continued = mirror is not None and not mirror.fresh  # the mirror holds this step's keys (the cache: at its flush)
    if not continued:
        write_kv(key, value, meta.k_caches[layer], meta.v_caches[layer], meta.slot_mapping,
                 all_valid=meta.slots_valid)
    if sampled is not None:
        assert mirror is None, "a step that continues the mirror samples every row"
        meta = sampled
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if meta.all_decode and sliding_window is None and softcap is None and q.is_cuda:  # the Triton decode kernel
        return decode_attention(q, meta.k_caches[layer], meta.v_caches[layer], meta.block_tables, meta.context_lens,
                                scale)
    layouts = meta.layouts.get(sliding_window)
    if layouts is None:
        if mirror is not None and continued and sliding_window is None and softcap is None:  # its kept mask
            layouts = (mirror.layout(meta.block_tables),)
        else:
            layouts = batched_layouts(
                q.shape[0], meta.k_caches[layer].shape[1], query_start_loc=meta.query_start_loc,
                context_lens=meta.context_lens, block_tables=meta.block_tables, sliding_window=sliding_window,
                max_query_len=meta.max_query_len, max_context_len=meta.max_context_len)
        meta.layouts[sliding_window] = layouts
    dense = None
    if mirror is not None and (continued or len(layouts) == 1 and layouts[0].whole):  # (a decode step's: whole)
        k_cache, v_cache = meta.k_caches[layer], meta.v_caches[layer]
        dense = mirror.layer(layer, key, value, lambda: gathered(k_cache, v_cache, layouts[0]))
    return paged_attention_batched(q, meta.k_caches[layer], meta.v_caches[layer],
                                   query_start_loc=meta.query_start_loc, context_lens=meta.context_lens,
                                   block_tables=meta.block_tables, scale=scale, sliding_window=sliding_window,
                                   soft_cap=softcap, layouts=layouts, dense=dense)


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
