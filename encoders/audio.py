"""Audio encoders of audio-language chat models: Qwen2-Audio (a Whisper-style encoder, then a projector).

A clip is resampled to the feature extractor's rate in the media workers; here it becomes log-mel features padded
to the encoder's 30 s window (so every clip of a checkpoint has the same shape: one bucket, stacked into one
forward, the padding masked out of attention), and its feature rows are the clip's frames through the encoder's
stride-2 convolution and its 2x pooling: `((frames - 1) // 2 + 1 - 2) // 2 + 1` placeholder tokens, frames being
ceil(samples / hop). The plan counts them from the clip's length alone, before any feature is computed.
"""

from __future__ import annotations

import math
from typing import Any, Hashable

import torch

from encoders.vision import EncoderAdapter, EncodeTask, Geometry, MediaItem, Prepared


class AudioAdapter(EncoderAdapter):
    """An audio encoder fed Whisper log-mel features: the rate its clips are decoded at, the longest clip it takes
    (its window: the feature extractor would cut a longer one silently, so it is refused), the plan and the
    features. A family gives bucket and encode."""

    def __init__(self, model, processor, **kwargs):
        super().__init__(model, processor, **kwargs)
        self.token_ids = {"audio": model.config.audio_token_id}
        extractor = processor.feature_extractor
        self.sample_rate = int(extractor.sampling_rate)  # the media workers resample every clip to it
        self.hop = int(extractor.hop_length)
        self.window = int(extractor.nb_max_frames)  # feature frames of the encoder's window
        self.max_seconds = extractor.n_samples / self.sample_rate

    def processor_config(self, kind: str) -> dict[str, Any]:
        return self.processor.feature_extractor.to_dict()

    def plan(self, media: MediaItem, options: dict[str, Any]) -> Geometry:
        if media.kind != "audio":
            raise ValueError(f"{self.family}'s audio encoder takes audio, not {media.kind}")
        samples = len(media.pixels)
        if samples == 0:
            raise ValueError("the audio clip is empty")
        if samples > self.max_seconds * self.sample_rate:
            raise ValueError(f"the audio clip is {samples / self.sample_rate:.1f} s; this model's audio encoder "
                             f"takes at most {self.max_seconds:g} s")
        frames = min(math.ceil(samples / self.hop), self.window)
        return Geometry("audio", audio_tokens(frames), audio_frames=frames)

    def prepare(self, task: EncodeTask) -> Prepared:
        out = self.processor.feature_extractor([task.media.pixels], sampling_rate=self.sample_rate,
                                               return_attention_mask=True, padding="max_length", return_tensors="pt")
        mask = out["attention_mask"]
        if int(mask.sum()) != task.geometry.audio_frames:  # the plan decided the prompt: it must hold
            raise ValueError(f"the feature extractor made {int(mask.sum())} frames for a clip planned as "
                             f"{task.geometry.audio_frames}")
        return Prepared(task, {"input_features": out["input_features"], "mask": mask})  # [1, mels, window], [1, w]


class Qwen2AudioAdapter(AudioAdapter):
    family = "qwen2_audio"

    def bucket(self, prepared: Prepared) -> Hashable:
        return tuple(prepared.tensors["input_features"].shape[1:])

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        """The model's own path (Qwen2AudioModel.forward): the encoder over the padded window with the padding
        masked, the projector, then each clip's first rows."""
        from transformers.masking_utils import create_bidirectional_mask

        inner = self.model.model
        tower = inner.audio_tower
        features = torch.cat([p.tensors["input_features"] for p in batch]).to(self.device, self.dtype)
        mask = torch.cat([p.tensors["mask"] for p in batch]).to(self.device)
        conv_lengths, lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
        rows = (features.shape[-1] - 2) // 2 + 1
        keep = (torch.arange(rows, device=self.device)[None, :] < conv_lengths[:, None]).long()
        attention = create_bidirectional_mask(config=tower.config, attention_mask=keep,
                                              inputs_embeds=torch.zeros(len(batch), rows, 1, dtype=self.dtype,
                                                                        device=self.device))
        hidden = tower(features, attention_mask=attention).last_hidden_state
        projected = inner.multi_modal_projector(hidden)
        return [projected[i, :int(n)] for i, n in enumerate(lengths.tolist())]


def audio_tokens(frames: int) -> int:
    """Feature rows of `frames` mel frames: the stride-2 convolution, then the 2x average pooling."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1
