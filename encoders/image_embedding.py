"""Image and text embeddings in one space from a CLIP checkpoint (`CLIPModel` + its processor).

Images go through the checkpoint's image processor and `get_image_features` (vision tower +
visual projection); texts through `get_text_features` (text tower + text projection). Both are
L2-normalised, as CLIP normalises them before comparing: the dot product of an image vector and a
text vector is their cosine similarity.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from encoders.text_embedding import TokenTemplate, local_dir, model_limit, pad, tokenize_texts


def _features(output) -> torch.Tensor:
    """get_*_features returns the projected vectors (transformers 4) or an output holding them as pooler_output (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipEncoder:
    """A CLIP model: decoded images or token sequences -> normalised vectors in one shared space."""

    accepts_images = True

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModel, AutoProcessor

        root = local_dir(path)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.processor = AutoProcessor.from_pretrained(root)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.model = AutoModel.from_pretrained(root, dtype=self.dtype).to(self.device).eval()
        if not (hasattr(self.model, "get_image_features") and hasattr(self.model, "get_text_features")):
            raise ValueError(f"{path}: {type(self.model).__name__} has no get_image_features/get_text_features; "
                             "clip-embedding serves CLIPModel checkpoints")
        text_config = self.model.config.text_config
        self.template = TokenTemplate.of(self.tokenizer, min(model_limit(self.tokenizer, text_config),
                                                             text_config.max_position_embeddings))
        self.dimension = self.model.config.projection_dim  # width of one vector
        self.vocab_size = text_config.vocab_size  # token ids must be below this
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.weights_id = f"clip-embedding:{path}"
        self._tokenizer_lock = threading.Lock()

    def tokenize(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Texts -> the token sequences the text tower reads (special tokens added, truncated to its 77 positions)."""
        return [self.template.wrap(ids) for ids in tokenize_texts(self.tokenizer, self._tokenizer_lock, texts)]

    def embed_tokens(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """One text-tower forward -> normalised float32 vectors [B, dimension] on the CPU."""
        ids, mask = pad(batch, self.pad_id)
        with torch.inference_mode():
            out = _features(self.model.get_text_features(input_ids=ids.to(self.device),
                                                         attention_mask=mask.to(self.device)))
            return torch.nn.functional.normalize(out.float(), dim=-1).cpu()

    def pixel_values(self, images: list) -> torch.Tensor:
        """PIL images -> the processor's pixel values [N, 3, H, W] (resize, crop, normalise)."""
        return self.image_processor(images=images, return_tensors="pt").pixel_values

    def embed_images(self, images: list) -> torch.Tensor:
        """One vision-tower forward over decoded images -> normalised float32 vectors [N, dimension] on the CPU."""
        pixels = self.pixel_values(images).to(self.device, self.dtype)
        with torch.inference_mode():
            out = _features(self.model.get_image_features(pixel_values=pixels))
            return torch.nn.functional.normalize(out.float(), dim=-1).cpu()
