"""Block-local attention for Qwen2.5-Omni's token2wav DiT: what its dense masked attention computes, in O(frames).

Each DiT layer lets a frame attend the frames of its own 24-frame block and, in the layers that look ahead or
back, of the next or previous block (`look_ahead_block` / `look_backward_block`, 0 or 1). transformers builds a
[batch, heads, frames, frames] distance matrix, compares it in every layer of every one of the flow's 36 evaluations
and runs dense SDPA under that mask: quadratic in the reply's length (a 4096-code reply: 8192 frames, minutes on a
CPU). Here the layers see block distances instead (`block_distances`: [batch, 1, blocks, blocks], so their
comparison is tiny) and `block_attention`, registered as the DiT's attention implementation, attends each block's
queries to the 3 blocks around it that the layer's block mask allows, padding keys left out: the same keys per
query as the dense mask, so the same attention up to float summation order.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

ATTENTION = "mmserve_dit_blocks"
# The running call's state, per thread (replicas sharing one DiT run calls side by side): its key validity (set by
# `dit_call`, read by `block_attention`) and its speaker encoder's output (`_SpeakerOnce`).
_call = threading.local()


def register(dit) -> None:
    """Make `dit` (a Qwen2_5OmniToken2WavDiTModel) attend block-locally, its layers reading block distances
    (`block_distances`), and run its speaker encoder once a `dit_call`: for good, at load."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, block_attention)
    dit.config._attn_implementation = ATTENTION
    for module in dit.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not dit.config:
            config._attn_implementation = ATTENTION
    dit._create_block_diff = lambda hidden: block_distances(hidden, dit.block_size)
    embed = dit.input_embed
    if not isinstance(embed.spk_encoder, _SpeakerOnce):
        embed.spk_encoder = _SpeakerOnce(embed.spk_encoder)


class dit_call:
    """Within the block, the running DiT call (in this thread): its real frames, `valid` [rows, frames] bool (padding
    False), and its speaker encoder's output, computed at the first evaluation and reused by the later ones (it reads
    the reference mels, the same at every evaluation of a call)."""

    def __init__(self, valid: torch.Tensor):
        self.valid = valid

    def __enter__(self):
        _call.valid, _call.speakers = self.valid, None

    def __exit__(self, *exc):
        _call.valid = _call.speakers = None


class _SpeakerOnce(torch.nn.Module):
    """The DiT's speaker encoder, run once a `dit_call` (every call outside one runs it)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_call, "valid", None) is None:
            return self.inner(x)
        if _call.speakers is None:
            _call.speakers = self.inner(x)
        return _call.speakers


def block_distances(hidden_states: torch.Tensor, block: int) -> torch.Tensor:
    """The DiT's block distances at block granularity: [rows, 1, blocks, blocks] (key block - query block)."""
    blocks = -(-hidden_states.shape[1] // block)
    index = torch.arange(blocks, device=hidden_states.device)
    return (index[None, :] - index[:, None]).expand(hidden_states.shape[0], 1, blocks, blocks)


def block_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of q/k/v [rows, heads, frames, dim] under a block mask [rows, 1, blocks, blocks] (True: the query
    block may attend the key block; only neighbours within one block can be True) -> [rows, frames, heads, dim]."""
    rows, heads, frames, dim = query.shape
    blocks, size = attention_mask.shape[-1], module.config.block_size  # the last block may be short
    padded = blocks * size
    valid = getattr(_call, "valid", None)
    if valid is None:
        valid = torch.ones(rows, frames, dtype=torch.bool, device=query.device)
    elif valid.shape[0] != rows:  # classifier-free guidance: [conditioned rows, unconditioned rows]
        valid = valid.repeat(rows // valid.shape[0], 1)

    def windows(x: torch.Tensor) -> torch.Tensor:  # [rows, heads, frames, dim] -> [rows, heads, blocks, 3 * size, dim]
        x = F.pad(x, (0, 0, size, padded - frames + size))
        return x.unfold(2, 3 * size, size).transpose(-1, -2)

    q = F.pad(query, (0, 0, 0, padded - frames)).view(rows, heads, blocks, size, dim)
    k, v = windows(key), windows(value)
    # which of the 3 neighbouring blocks each query block may attend: the layer's mask on the band
    band = torch.zeros(rows, blocks, 3, dtype=torch.bool, device=query.device)
    mask = attention_mask[:, 0]
    for offset in (-1, 0, 1):
        lo, hi = max(0, -offset), blocks - max(0, offset)
        idx = torch.arange(lo, hi, device=query.device)
        band[:, lo:hi, offset + 1] = mask[:, idx, idx + offset]
    keys = F.pad(valid, (size, padded - frames + size)).unfold(1, 3 * size, size)  # [rows, blocks, 3 * size]
    allowed = band.repeat_interleave(size, dim=-1) & keys  # [rows, blocks, 3 * size]
    queries = F.pad(valid, (0, padded - frames)).view(rows, blocks, size)
    # a padding query attends every key of its window (its output is cut away): no row is empty
    allowed = allowed[:, :, None, :] | ~queries[..., None]  # [rows, blocks, size, 3 * size]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).reshape(rows * blocks, heads, size, dim),
        k.transpose(1, 2).reshape(rows * blocks, heads, 3 * size, dim),
        v.transpose(1, 2).reshape(rows * blocks, heads, 3 * size, dim),
        attn_mask=allowed.reshape(rows * blocks, 1, size, 3 * size), scale=scaling)
    out = out.view(rows, blocks, heads, size, dim).permute(0, 1, 3, 2, 4).reshape(rows, padded, heads, dim)
    return out[:, :frames], None
