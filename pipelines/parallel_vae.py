"""The parallel VAE decode of a video ([models.parallel] vae = true): the tiled decode's spatial tiles spread over
the denoise replica's ranks, then blended on rank 0 exactly as the one-rank tiled decode blends them.

A tiled decode cuts the latents into overlapping tiles, decodes each through every frame (Wan's decoder is causal in
time: a tile carries its own feature cache from frame to frame, so tiles are independent of each other but frames
are not), and blends each tile into its upper and left neighbours over the overlap. Here tile k goes to rank
k % ranks, a round of `ranks` tiles at a time; rank 0 then blends in the same order with the VAE's own blend_v and
blend_h, so the video equals `vae.tiled_decode`'s (tests/test_parallel.py compares them). Wan's VAE
(AutoencoderKLWan, Wan 2.1's layout) is covered; a model whose VAE is another is refused at load naming
parallel.vae.
"""

from __future__ import annotations

from typing import Any

import torch

WAN_VAE = "AutoencoderKLWan"


def check_parallel_vae(family: Any) -> None:
    """At load: the family's VAE is one this module decodes (else a ValueError naming parallel.vae)."""
    vae = family.pipe.vae
    if type(vae).__name__ != WAN_VAE or vae.config.get("patch_size") is not None:
        raise ValueError(f"parallel.vae: the parallel decode covers Wan 2.1's VAE ({WAN_VAE} without patches); "
                         f"model {family.name} has a {type(vae).__name__}")


def tiles_apply(vae, z: torch.Tensor) -> bool:
    """Whether `vae.decode(z)` would decode in tiles (tiling on and the latents larger than one tile)."""
    ratio = vae.spatial_compression_ratio
    return bool(vae.use_tiling) and (z.shape[-1] > vae.tile_sample_min_width // ratio or
                                     z.shape[-2] > vae.tile_sample_min_height // ratio)


@torch.inference_mode()
def decode_tile(vae, z: torch.Tensor) -> torch.Tensor:
    """One tile's latents [B, C, T, h, w] -> its decoded frames, frame after frame through one feature cache."""
    vae.clear_cache()
    frames = []
    for k in range(z.shape[2]):
        vae._conv_idx = [0]  # the decoder's position in the feature cache, from the start each frame
        x = vae.post_quant_conv(z[:, :, k:k + 1])
        frames.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


@torch.inference_mode()
def parallel_tiled_decode(family: Any, z: torch.Tensor) -> torch.Tensor:
    """`vae.tiled_decode(z)` (values clamped to [-1, 1]) with the tiles decoded across `family.ranks`."""
    vae, ranks = family.pipe.vae, family.ranks
    ratio = vae.spatial_compression_ratio
    tile_h, tile_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    rows = range(0, z.shape[-2], vae.tile_sample_stride_height // ratio)
    cols = range(0, z.shape[-1], vae.tile_sample_stride_width // ratio)
    starts = [(i, j) for i in rows for j in cols]
    decoded: dict[tuple[int, int], torch.Tensor] = {}
    for first in range(0, len(starts), ranks.world):
        batch = starts[first:first + ranks.world]
        parts: list[dict[str, Any] | None] = [{"z": z[:, :, :, i:i + tile_h, j:j + tile_w].contiguous()}
                                              for i, j in batch]
        parts += [None] * (ranks.world - len(batch))
        outputs = ranks.forward("vae", parts, {}, lambda inputs: decode_tile(vae, inputs["z"]),
                                replies=set(range(1, len(batch))), method="decode_vae_tile")
        for start, out in zip(batch, outputs, strict=False):
            assert out is not None  # every rank with a tile replies
            decoded[start] = out
    # Blend as the one-rank decode does, in its order: blend_v and blend_h change the later tile in place, so a
    # tile is blended with its upper neighbour as that neighbour was left after its own blending.
    blend_h = vae.tile_sample_min_height - vae.tile_sample_stride_height
    blend_w = vae.tile_sample_min_width - vae.tile_sample_stride_width
    keep_h, keep_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    grid = [[decoded[(i, j)] for j in cols] for i in rows]
    bands = []
    for r, row in enumerate(grid):
        kept = []
        for c, tile in enumerate(row):
            if r:
                tile = vae.blend_v(grid[r - 1][c], tile, blend_h)
            if c:
                tile = vae.blend_h(row[c - 1], tile, blend_w)
            row[c] = tile
            kept.append(tile[:, :, :, :keep_h, :keep_w])
        bands.append(torch.cat(kept, dim=-1))
    video = torch.cat(bands, dim=3)[:, :, :, :z.shape[-2] * ratio, :z.shape[-1] * ratio]
    return torch.clamp(video, min=-1.0, max=1.0)
