"""Sentence embeddings from a transformers encoder, as the checkpoint's sentence-transformers files say.

A sentence-transformers checkpoint is a plain transformers model plus a few small files:

    modules.json                the pipeline: Transformer -> Pooling [-> Normalize]
    sentence_bert_config.json   max_seq_length (truncation, special tokens included), do_lower_case
    1_Pooling/config.json       pooling_mode_* flags: cls, max, mean, mean_sqrt_len, lasttoken

A checkpoint without them (a bare `BertModel`, ...) is read as mean pooling, no normalisation,
truncated at the tokenizer's `model_max_length`. Modules mmserve cannot reproduce (Dense,
weighted-mean pooling, ...) are refused at load, never silently skipped.

Texts longer than the limit are truncated, as sentence-transformers does: the special tokens
are kept and the end of the text is cut.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

# Pooling modes in the order sentence-transformers concatenates them when several are on.
POOLING_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
_UNSUPPORTED_POOLING = ("pooling_mode_weightedmean_tokens",)
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class SentenceConfig:
    model_dir: Path  # the transformer's weights and tokenizer (the checkpoint or its module folder)
    pooling: tuple[str, ...]  # POOLING_FLAGS keys, concatenated in this order
    normalize: bool  # L2-normalise the pooled vector (a Normalize module is listed)
    max_seq_length: int | None  # tokens per text, special tokens included; None: the tokenizer's limit
    do_lower_case: bool  # lower-case texts before tokenizing


def local_dir(path: str) -> Path:
    """A local directory, or the local snapshot of a cached hub id (the server is offline)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))


def read_sentence_config(path: str) -> SentenceConfig:
    """The embedding recipe of a checkpoint: its modules.json when there is one, else mean pooling."""
    root = local_dir(path)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return SentenceConfig(root, ("mean",), False, None, False)
    modules = json.loads(modules_file.read_text())
    model_dir, pooling, normalize = None, None, False
    for module in modules:
        kind = module.get("type", "").removeprefix(_ST)
        folder = root / module.get("path", "")
        if kind == "Transformer":
            model_dir = folder
        elif kind == "Pooling":
            pooling = _pooling_modes(folder / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: modules.json lists a {module.get('type')!r} module; mmserve embeds with "
                             "Transformer, Pooling and Normalize modules only")
    if model_dir is None:
        raise ValueError(f"{path}: modules.json lists no Transformer module")
    bert = {}
    for name in ("sentence_bert_config.json", "sentence_xlnet_config.json"):
        if (model_dir / name).is_file():
            bert = json.loads((model_dir / name).read_text())
            break
    return SentenceConfig(model_dir, pooling or ("mean",), normalize, bert.get("max_seq_length"),
                          bool(bert.get("do_lower_case", False)))


def _pooling_modes(config_file: Path) -> tuple[str, ...]:
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for flag in _UNSUPPORTED_POOLING:
        if config.get(flag):
            raise ValueError(f"{config_file}: {flag} is not supported; mmserve pools with {list(POOLING_FLAGS)}")
    modes = tuple(mode for mode, flag in POOLING_FLAGS.items() if config.get(flag))
    return modes or ("mean",)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Pooled vectors, as sentence-transformers' Pooling computes them.
    hidden [B, T, H], mask [B, T] -> [B, H * len(modes)]."""
    hidden = hidden.float()
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    counts = m.sum(1).clamp(min=1e-9)  # [B, 1]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, -1e9).max(1).values)
        elif mode == "mean":
            out.append((hidden * m).sum(1) / counts)
        elif mode == "mean_sqrt_len":
            out.append((hidden * m).sum(1) / counts.sqrt())
        elif mode == "lasttoken":  # the last attended position, wherever the padding sits
            last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)  # [B]
            out.append(hidden[torch.arange(hidden.shape[0]), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}; known: {list(POOLING_FLAGS)}")
    return torch.cat(out, dim=-1)


@dataclass(frozen=True)
class TokenTemplate:
    """The special tokens a tokenizer puts around one text, and the length limit with them included."""

    prefix: tuple[int, ...]  # before the text ([CLS], <|startoftext|>)
    suffix: tuple[int, ...]  # after it ([SEP], <|endoftext|>)
    max_tokens: int  # the whole sequence, special tokens included

    def __post_init__(self):
        if self.max_tokens <= len(self.prefix) + len(self.suffix):
            raise ValueError(f"a length limit of {self.max_tokens} leaves no room for text")

    @classmethod
    def of(cls, tokenizer, max_tokens: int) -> "TokenTemplate":
        """Found by encoding a probe word with and without special tokens."""
        bare = tokenizer("a", add_special_tokens=False).input_ids
        full = tokenizer("a").input_ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return cls(tuple(full[:start]), tuple(full[start + len(bare):]), max_tokens)
        raise ValueError(f"cannot tell where {type(tokenizer).__name__} puts its special tokens")

    def wrap(self, ids: Sequence[int]) -> tuple[int, ...]:
        """Text token ids -> the sequence the model reads: special tokens around, the text's end cut to fit."""
        room = self.max_tokens - len(self.prefix) - len(self.suffix)
        return self.prefix + tuple(ids[:room]) + self.suffix


def pad(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the attention mask, both [B, T_max]."""
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids, mask


def tokenize_texts(tokenizer, lock: threading.Lock, texts: Sequence[str]) -> list[list[int]]:
    """Text token ids without special tokens (a fast tokenizer is not safe to call from two threads)."""
    if not texts:
        return []  # transformers' tokenizers fail on an empty batch
    with lock:
        return tokenizer(list(texts), add_special_tokens=False, verbose=False).input_ids


def model_limit(tokenizer, config) -> int:
    """The longest sequence a model takes: the tokenizer's model_max_length, unless it is a placeholder."""
    limit = getattr(tokenizer, "model_max_length", None)
    positions = getattr(config, "max_position_embeddings", None)
    if limit is None or limit > 1_000_000:  # transformers' "no limit" sentinel
        limit = positions or 512
    return int(limit)


class SentenceEncoder:
    """A transformers encoder + pooling [+ normalisation]: token sequences -> sentence vectors."""

    accepts_images = False

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModel, AutoTokenizer

        self.config = read_sentence_config(path)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_dir)
        self.model = AutoModel.from_pretrained(self.config.model_dir,
                                               dtype=getattr(torch, dtype)).to(self.device).eval()
        limit = model_limit(self.tokenizer, self.model.config)
        self.template = TokenTemplate.of(self.tokenizer, min(self.config.max_seq_length or limit, limit))
        self.dimension = self.model.config.hidden_size * len(self.config.pooling)  # width of one vector
        self.vocab_size = self.model.get_input_embeddings().num_embeddings  # token ids must be below this
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.weights_id = f"embedding:{path}"
        self._tokenizer_lock = threading.Lock()

    def tokenize(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Texts -> the token sequences the model reads (special tokens added, truncated to the limit)."""
        if self.config.do_lower_case:
            texts = [t.lower() for t in texts]
        return [self.template.wrap(ids) for ids in tokenize_texts(self.tokenizer, self._tokenizer_lock, texts)]

    def embed_tokens(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward over right-padded sequences -> float32 vectors [B, dimension] on the CPU."""
        ids, mask = pad(batch, self.pad_id)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            out = pool(hidden, mask.to(self.device), self.config.pooling)
            if self.config.normalize:
                out = torch.nn.functional.normalize(out, dim=-1)
        return out.cpu()

    def embed_images(self, images: list) -> torch.Tensor:
        raise TypeError("a text embedding model takes no images")
