"""Qwen2.5-Omni's thinker encoders: its vision tower (Qwen2.5-VL's: dynamic resolution, grids, M-RoPE) and its
audio encoder (Whisper features over 30 s, the valid frames only, 25 tokens a second).

The audio encoder runs on each clip's valid mel frames (in 2 s windows of its own), never on padding, so a clip's
features do not depend on what it is batched with: clips of any length share one forward, concatenated. A
clip of L mel frames (L = ceil(samples / hop)) has `((L - 1) // 2 + 1 - 2) // 2 + 1` placeholder tokens, as the
processor counts them. The prompt's 3-D positions come from the thinker's own `get_rope_index`, which places the
audio spans by their frame counts and the images and videos by their grids.
"""

from __future__ import annotations

from typing import Hashable

import torch

from encoders.audio import AudioAdapter
from encoders.qwen2_vl import Qwen2VLAdapter
from encoders.vision import Prepared


class OmniVisionAdapter(Qwen2VLAdapter):
    """Images and video through the thinker's vision tower; the prompt's positions for every media kind."""

    family = "qwen2_5_omni"

    def rope_positions(self, input_ids: list[int], geometries: list) -> tuple[torch.Tensor, int]:
        images = [g.grid_thw for g in geometries if g.kind == "image"]
        videos = [g for g in geometries if g.kind == "video"]
        audios = [g.audio_frames for g in geometries if g.kind == "audio"]
        positions, delta = self.model.model.get_rope_index(
            torch.tensor([input_ids], dtype=torch.long), image_grid_thw=torch.tensor(images) if images else None,
            video_grid_thw=torch.tensor([g.grid_thw for g in videos]) if videos else None,
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            audio_seqlens=torch.tensor(audios) if audios else None,
            second_per_grids=torch.tensor([g.second_per_grid for g in videos]) if videos else None)
        return positions[:, 0].cpu(), int(delta.reshape(-1)[0])


class OmniAudioAdapter(AudioAdapter):
    """Audio clips through the thinker's audio encoder (and its projection to the text width)."""

    family = "qwen2_5_omni"

    def bucket(self, prepared: Prepared) -> Hashable:
        return "audio"  # only the valid frames are encoded: clips of any length share a forward

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        features = torch.cat([p.tensors["input_features"] for p in batch]).to(self.device, self.dtype)
        mask = torch.cat([p.tensors["mask"] for p in batch]).to(self.device)
        out = self.model.model.get_audio_features(features, feature_attention_mask=mask).last_hidden_state
        return list(torch.split(out, [p.task.geometry.num_tokens for p in batch]))
