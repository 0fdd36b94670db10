"""Qwen3-Omni's thinker encoders: its vision tower (Qwen3-VL's: patch 16, grids, interleaved M-RoPE) and its audio
encoder (Whisper features, chunks of 2 * n_window frames, 13 tokens a full chunk; clips up to the feature
extractor's 30 s, as for Qwen2.5-Omni).

Audio: each clip is featurized alone and unpadded, as the processor does for one clip (`padding=True`): its
L = samples // hop mel frames (a padded window would change the last frames' values: the STFT reflects the clip's
end instead of reading zeros), and `_get_feat_extract_output_lengths(L, n_window)` placeholder tokens. The encoder
runs each clip's valid frames only, windowed within the clip, so clips of any length share one forward.

Vision: images through the tower's merger. A tower with deepstack mergers (the released checkpoints: its layers 8, 16
and 24 are added to the first text layers' hidden states at the image positions) needs the llm runner to inject
those features; it does not yet, so such a checkpoint is served without image input (the adapter claims no kind,
and an image part is refused naming its field). Videos are not served: their temporal positions
(`second_per_grid * position_id_per_seconds`) may be fractional, and mmserve's positions are integers.

The prompt's 3-D positions come from the thinker's own `get_rope_index` (audio spans by their frame counts, images
by their grids).
"""

from __future__ import annotations

import torch

from encoders.omni import OmniAudioAdapter, OmniVisionAdapter
from encoders.vision import EncodeTask, Geometry, MediaItem, Prepared


class Omni3VisionAdapter(OmniVisionAdapter):
    """Images through the thinker's vision tower (none when it has deepstack mergers); every kind's positions."""

    family = "qwen3_omni"

    def __init__(self, model, processor, **kwargs):
        super().__init__(model, processor, **kwargs)
        deepstack = model.config.vision_config.deepstack_visual_indexes
        self.token_ids = {} if deepstack else {"image": model.config.image_token_id}

    def rope_positions(self, input_ids: list[int], geometries: list) -> tuple[torch.Tensor, int]:
        positions, delta = super().rope_positions(input_ids, geometries)  # float: video times may be fractional
        assert torch.equal(positions, positions.round())  # images and audio have whole positions (video is not served)
        return positions.long(), delta


class Omni3AudioAdapter(OmniAudioAdapter):
    """Audio clips through the thinker's audio encoder, each featurized alone and unpadded."""

    family = "qwen3_omni"

    def __init__(self, model, processor, **kwargs):
        super().__init__(model, processor, **kwargs)
        self.n_window = model.config.audio_config.n_window
        self.min_samples = self.processor.feature_extractor.n_fft // 2 + 1  # the STFT's reflect padding needs it

    def plan(self, media: MediaItem, options: dict) -> Geometry:
        if media.kind == "audio" and 0 < len(media.pixels) < self.min_samples:
            raise ValueError(f"the audio clip is {len(media.pixels)} samples; this model's feature extractor needs "
                             f"at least {self.min_samples}")
        super().plan(media, options)  # kind, emptiness and the window's length limit
        frames = len(media.pixels) // self.hop
        return Geometry("audio", audio_tokens(frames, self.n_window), audio_frames=frames)

    def prepare(self, task: EncodeTask) -> Prepared:
        out = self.processor.feature_extractor([task.media.pixels], sampling_rate=self.sample_rate,
                                               return_attention_mask=True, padding=True, truncation=False,
                                               return_tensors="pt")
        frames = int(out["attention_mask"].sum())
        if frames != task.geometry.audio_frames:  # the plan decided the prompt: it must hold
            raise ValueError(f"the feature extractor made {frames} frames for a clip planned as "
                             f"{task.geometry.audio_frames}")
        return Prepared(task, {"input_features": out["input_features"]})  # [1, mels, frames]

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        lengths = [p.tensors["input_features"].shape[-1] for p in batch]  # each clip's frames (prepare checked)
        features = torch.zeros(len(batch), batch[0].tensors["input_features"].shape[1], max(lengths))
        mask = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        for i, (p, n) in enumerate(zip(batch, lengths)):  # padded here only to stack; the encoder reads the valid
            features[i, :, :n] = p.tensors["input_features"][0]  # frames alone
            mask[i, :n] = 1
        out = self.model.model.get_audio_features(features.to(self.device, self.dtype),
                                                  feature_attention_mask=mask.to(self.device)).last_hidden_state
        return list(torch.split(out, [p.task.geometry.num_tokens for p in batch]))


def audio_tokens(frames: int, n_window: int) -> int:
    """Placeholder tokens of `frames` mel frames (transformers' `_get_feat_extract_output_lengths`): 13 a full chunk
    of 2 * n_window frames, and the remainder through three stride-2 convolutions."""
    chunk = n_window * 2
    rest = (frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + frames // chunk * 13
