"""Sequence parallelism where diffusers' context-parallel plan is missing (SD3) or does not run as it is (LTX).

SD3 (MMDiT) has no plan: its joint attention concatenates the image tokens with the text tokens (CLIP's 77 and T5's
256 = 333, which no even degree divides) and calls SDPA itself. Here the image tokens are split at the first
block (after the patch embedding and its positions) and gathered at `proj_out`; the text stream stays whole on
every rank. Inside the joint attention the image queries, keys and values go through Ulysses (all-to-all: the
whole image sequence, a slice of the heads) and ring (every ring rank's image keys and values gathered), the
text's are sliced to the same heads locally, and the text's output is gathered back to all heads. Each rank thus
computes the text stream in full and a shard of the image stream; the math is the one-device forward's.

LTX's plan splits its text (the cross-attention's keys) and the text's attention mask, and the mask keeps the
unsplit width once Ulysses gathers the keys back: the forward fails. Here the text is not split: the
cross-attention (image queries, text keys) runs locally on each rank's image shard with the whole text and mask,
no collective; the self-attention keeps diffusers' Ulysses/ring.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def sequence_parallel_plan(family: str, module: Any) -> dict[str, Any]:
    """The context-parallel plan this denoiser runs under: diffusers' own, or ours for SD3 and LTX."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    if family == "sd3":
        return {"transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3,
                                                                               split_output=False)},
                "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    plan = dict(module._cp_plan or {})
    if family == "ltx":
        plan[""] = {"hidden_states": plan[""]["hidden_states"]}  # the text and its mask stay whole
    return plan


def before_parallel(family: str, module: Any) -> None:
    """SD3's attention processors become the sequence-parallel joint attention (before enable_parallelism gives
    them the config)."""
    if family == "sd3":
        for block in module.transformer_blocks:
            block.attn.set_processor(JointAttentionSequenceParallel())
            if getattr(block, "attn2", None) is not None:
                block.attn2.set_processor(JointAttentionSequenceParallel())


def after_parallel(family: str, module: Any) -> None:
    """What enable_parallelism set that this family's plan does not want: LTX's cross-attention runs on the
    rank's own image shard against the whole text, so its processor gets no parallel config."""
    if family == "ltx":
        for block in module.transformer_blocks:
            if block.attn2.processor is block.attn1.processor:  # one shared instance: give attn2 its own
                block.attn2.set_processor(type(block.attn1.processor)())
            block.attn2.processor._parallel_config = None


def image_tokens(module: Any, latents: torch.Tensor) -> int:
    """How many image tokens the denoiser's sequence has for these latents ([B, C, H, W] or [B, C, F, H, W])."""
    patch = module.config.patch_size
    sizes = (patch, patch) if isinstance(patch, int) else tuple(patch)  # SD3's int patches H and W; Wan's (t, h, w)
    count = 1
    for dim, size in zip(latents.shape[2:], sizes, strict=True):
        count *= dim // size
    return count


class JointAttentionSequenceParallel:
    """SD3's joint attention (diffusers' JointAttnProcessor2_0) over a (ring, ulysses) mesh: image tokens sharded,
    text tokens whole on every rank (see the module docstring). With no parallel config it is the plain
    processor's math."""

    _attention_backend = None  # SDPA itself: diffusers' backend check passes it by
    _parallel_config = None  # set by enable_parallelism

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if attention_mask is not None:
            raise ValueError("SD3's sequence-parallel attention takes no attention mask")
        image = self._heads(attn, hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        text = None
        if encoder_hidden_states is not None:
            text = self._heads(attn, encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                               attn.norm_added_q, attn.norm_added_k)
        cp = self._parallel_config.context_parallel_config if self._parallel_config is not None else None
        image_out, text_out = _joint_attention(image, text, cp)
        batch = hidden_states.shape[0]
        hidden_states = attn.to_out[1](attn.to_out[0](image_out.reshape(batch, image_out.shape[1], -1)))
        if text_out is None:
            return hidden_states
        text_states = text_out.reshape(batch, text_out.shape[1], -1)
        if not attn.context_pre_only:
            text_states = attn.to_add_out(text_states)
        return hidden_states, text_states

    @staticmethod
    def _heads(attn: Any, states: torch.Tensor, to_q: Any, to_k: Any, to_v: Any, norm_q: Any, norm_k: Any):
        """q, k, v as [B, S, H, D] (the layout the collectives split), normed per head as the plain processor."""
        batch = states.shape[0]
        q, k, v = (proj(states).view(batch, -1, attn.heads, attn.inner_dim // attn.heads) for proj in
                   (to_q, to_k, to_v))
        if norm_q is not None:
            q = norm_q(q)
        if norm_k is not None:
            k = norm_k(k)
        return q, k, v


def _joint_attention(image: tuple[torch.Tensor, ...], text: tuple[torch.Tensor, ...] | None,
                     cp: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of [image; text] queries over [image; text] keys, each [B, S, H, D]: the image tensors are this
    rank's shard, the text's whole. Returns this rank's image output [B, S/n, H, D] and the whole text output."""
    q, k, v = image
    ulysses = cp is not None and cp.ulysses_degree > 1
    ring = cp is not None and cp.ring_degree > 1
    if ulysses:  # the ulysses group's shards, this rank's heads
        group = cp._ulysses_mesh.get_group()
        q, k, v = (_seq_to_heads(x, cp.ulysses_degree, group) for x in (q, k, v))
    if ring:  # every ring rank's keys and values: the whole image sequence
        group = cp._ring_mesh.get_group()
        k, v = (_gather(x, 1, group) for x in (k, v))
    n_image = q.shape[1]
    if text is not None:
        tq, tk, tv = text
        if ulysses:
            width = tq.shape[2] // cp.ulysses_degree
            lo = cp._ulysses_local_rank * width
            tq, tk, tv = (x[:, :, lo:lo + width] for x in (tq, tk, tv))
        q, k, v = (torch.cat([a, b], dim=1) for a, b in ((q, tq), (k, tk), (v, tv)))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out.transpose(1, 2).to(q.dtype)
    image_out, text_out = out[:, :n_image], (out[:, n_image:] if text is not None else None)
    if ulysses:
        group = cp._ulysses_mesh.get_group()
        image_out = _heads_to_seq(image_out, cp.ulysses_degree, group)
        if text_out is not None:
            text_out = _gather(text_out.contiguous(), 2, group)
    return image_out, text_out


def _seq_to_heads(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """[B, S/n, H, D] on each of n ranks -> [B, S, H/n, D]: the ranks' sequence shards in rank order, this rank's
    slice of the heads."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [n, B, S/n, H/n, D]: head group first
    x = _all_to_all(x, group)  # row i: rank i's tokens, this rank's heads
    return x.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """The inverse of _seq_to_heads: [B, S, H/n, D] -> this rank's [B, S/n, H, D]."""
    b, s, h, d = x.shape
    x = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [n, B, S/n, H/n, D]: token shard first
    x = _all_to_all(x, group)  # row i: this rank's tokens, rank i's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    shape = x.shape
    out = funcol.all_to_all_single(x.flatten(), None, None, group)
    return _waited(out).reshape(shape)


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The group's tensors concatenated along dim, in rank order."""
    from torch.distributed import _functional_collectives as funcol

    return _waited(funcol.all_gather_single(x.contiguous(), gather_dim=dim, group=group))


def _waited(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x
