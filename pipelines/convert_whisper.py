"""CTranslate2 Whisper (faster-whisper's format) -> a standard transformers Whisper checkpoint.

A CTranslate2 model directory holds `model.bin` (every weight, named), `config.json` (suppress
lists, language ids, alignment heads) and `tokenizer.json`. `model.bin` is, little-endian:

    u32 binary version (6) | str spec name ("WhisperSpec") | u32 spec revision
    u32 count, then per variable: str name | u8 rank | u32 dims[rank] | u8 dtype | u32 nbytes | bytes
    u32 count, then per alias: str alias | str variable name

where `str` is a u16 length (including a trailing NUL) followed by UTF-8 bytes. Attention is
stored fused: self-attention `linear_0` is [q; k; v], cross-attention `linear_0` is q and
`linear_1` is [k; v]; Whisper's k projection has no bias, so its third of the fused bias is zero.
Pure numpy + transformers: CTranslate2 itself is not needed.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5 (bfloat16) is refused
SPECIAL_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 0.02 s steps, after the special tokens
MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp may be at most 1.0 s (openai-whisper's default)


def read_ct2_model(path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) of a CTranslate2 model.bin; aliases resolved to their arrays."""
    data = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        n = take("H")
        nonlocal pos
        text = data[pos:pos + n - 1].decode("utf-8")
        pos += n
        return text

    version = take("I")
    if version < 5:
        raise ValueError(f"{path}: CTranslate2 binary version {version} is too old (5 or newer is read)")
    spec = string()
    take("I")  # the spec revision: the layout read here is the same for every revision seen
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        dtype_id, nbytes = take("B"), take("I")
        if dtype_id not in CT2_DTYPES:
            raise ValueError(f"{path}: variable {name} has CTranslate2 dtype id {dtype_id}; only float32/16 and "
                             "integer variables are read (re-export the model with --quantization float16)")
        variables[name] = np.frombuffer(data, CT2_DTYPES[dtype_id], nbytes // np.dtype(CT2_DTYPES[dtype_id]).itemsize,
                                        pos).reshape(shape)
        pos += nbytes
    for _ in range(take("I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    return spec, variables


def _layers(v: dict[str, np.ndarray], prefix: str) -> int:
    return len({name.split("/")[1] for name in v if re.match(rf"{prefix}/layer_\d+/", name)})


def _attention(v, src: str, dst: str, *, fused_kv: bool) -> dict[str, np.ndarray]:
    """CTranslate2 attention (fused q/k/v or q + fused k/v) -> separate transformers projections."""
    if fused_kv:  # cross-attention: q from the decoder, [k; v] from the encoder output
        q_w, q_b = v[f"{src}/linear_0/weight"], v[f"{src}/linear_0/bias"]
        k_w, v_w = np.split(v[f"{src}/linear_1/weight"], 2)
        _, v_b = np.split(v[f"{src}/linear_1/bias"], 2)
        out = f"{src}/linear_2"
    else:
        q_w, k_w, v_w = np.split(v[f"{src}/linear_0/weight"], 3)
        q_b, _, v_b = np.split(v[f"{src}/linear_0/bias"], 3)
        out = f"{src}/linear_1"
    return {f"{dst}.q_proj.weight": q_w, f"{dst}.q_proj.bias": q_b, f"{dst}.k_proj.weight": k_w,
            f"{dst}.v_proj.weight": v_w, f"{dst}.v_proj.bias": v_b,
            f"{dst}.out_proj.weight": v[f"{out}/weight"], f"{dst}.out_proj.bias": v[f"{out}/bias"]}


def _norm(v, src: str, dst: str) -> dict[str, np.ndarray]:
    return {f"{dst}.weight": v[f"{src}/gamma"], f"{dst}.bias": v[f"{src}/beta"]}


def _ffn(v, src: str, dst: str) -> dict[str, np.ndarray]:
    return {f"{dst}.fc1.weight": v[f"{src}/linear_0/weight"], f"{dst}.fc1.bias": v[f"{src}/linear_0/bias"],
            f"{dst}.fc2.weight": v[f"{src}/linear_1/weight"], f"{dst}.fc2.bias": v[f"{src}/linear_1/bias"],
            **_norm(v, f"{src}/layer_norm", f"{dst}.final_layer_norm")}


def whisper_state_dict(v: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CTranslate2 WhisperSpec variables -> WhisperForConditionalGeneration's state dict (numpy)."""
    sd = {"model.encoder.embed_positions.weight": v["encoder/position_encodings/encodings"],
          "model.decoder.embed_positions.weight": v["decoder/position_encodings/encodings"],
          "model.decoder.embed_tokens.weight": v["decoder/embeddings/weight"],
          **_norm(v, "encoder/layer_norm", "model.encoder.layer_norm"),
          **_norm(v, "decoder/layer_norm", "model.decoder.layer_norm")}
    for conv in ("conv1", "conv2"):
        sd[f"model.encoder.{conv}.weight"] = v[f"encoder/{conv}/weight"]
        sd[f"model.encoder.{conv}.bias"] = v[f"encoder/{conv}/bias"]
    for i in range(_layers(v, "encoder")):
        src, dst = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        sd.update(_attention(v, f"{src}/self_attention", f"{dst}.self_attn", fused_kv=False))
        sd.update(_norm(v, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm"))
        sd.update(_ffn(v, f"{src}/ffn", dst))
    for i in range(_layers(v, "decoder")):
        src, dst = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        sd.update(_attention(v, f"{src}/self_attention", f"{dst}.self_attn", fused_kv=False))
        sd.update(_norm(v, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm"))
        sd.update(_attention(v, f"{src}/attention", f"{dst}.encoder_attn", fused_kv=True))
        sd.update(_norm(v, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm"))
        sd.update(_ffn(v, f"{src}/ffn", dst))
    return sd


def _tokenizer(src: Path, vocab_size: int):
    """WhisperTokenizer from the shipped tokenizer.json, plus the timestamp tokens it leaves out."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    data = json.loads((src / "tokenizer.json").read_text())
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    tokenizer = WhisperTokenizer(vocab=data["model"]["vocab"], merges=merges, model_max_length=1024)
    specials = sorted((t for t in data["added_tokens"] if t["content"] != "<|endoftext|>"), key=lambda t: t["id"])
    # Registered as special (not only added): decode(skip_special_tokens) and decode_with_timestamps rely on
    # all_special_ids ending at <|notimestamps|>, the last id before the timestamps.
    tokenizer.add_special_tokens({"extra_special_tokens": [
        AddedToken(t["content"], lstrip=False, rstrip=False, normalized=False, special=True) for t in specials]})
    timestamps = [AddedToken(f"<|{i * 0.02:.2f}|>", lstrip=False, rstrip=False, normalized=False, special=False)
                  for i in range(SPECIAL_TIMESTAMPS)]
    tokenizer.add_tokens(timestamps)
    for t in specials:
        assert tokenizer.convert_tokens_to_ids(t["content"]) == t["id"], t
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{src}: tokenizer has {len(tokenizer)} tokens with timestamps, the model {vocab_size}")
    return tokenizer, [t["content"] for t in specials]


def convert_whisper_ct2(src: str | Path, dst: str | Path, *, dtype: str = "float32") -> Path:
    """Write a transformers Whisper checkpoint (model, processor, generation config) for a CTranslate2 one."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    src, dst = Path(src), Path(dst)
    for name in ("model.bin", "config.json", "tokenizer.json"):
        if not (src / name).is_file():
            raise ValueError(f"{src} is not a CTranslate2 Whisper directory: {name} is missing")
    spec, v = read_ct2_model(src / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{src}/model.bin holds a {spec}, not a WhisperSpec")
    ct2 = json.loads((src / "config.json").read_text())
    # 1. dimensions, read off the weights
    vocab_size, d_model = v["decoder/embeddings/weight"].shape
    tokenizer, specials = _tokenizer(src, vocab_size)
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    multilingual = vocab_size >= 51865  # openai-whisper's own test: .en models have one language token fewer
    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=v["encoder/conv1/weight"].shape[1], d_model=d_model,
        encoder_layers=_layers(v, "encoder"), decoder_layers=_layers(v, "decoder"),
        encoder_attention_heads=int(v["encoder/num_heads"]), decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        suppress_tokens=ct2["suppress_ids"], begin_suppress_tokens=ct2["suppress_ids_begin"],
        tie_word_embeddings=True, architectures=["WhisperForConditionalGeneration"])
    # 2. weights
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    state = {k: torch.from_numpy(np.array(a, dtype=np.float32)) for k, a in whisper_state_dict(v).items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{src}/model.bin lacks weights for {missing[:5]}")
    model = model.to(getattr(torch, dtype)).eval()
    # 3. generation config: what English (and multilingual) transcription needs
    languages = [t for t in specials if len(t) <= 7 and t[2:-2].isalpha()]  # <|en|>, <|haw|>, ...
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        suppress_tokens=list(ct2["suppress_ids"]), begin_suppress_tokens=list(ct2["suppress_ids_begin"]),
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX, is_multilingual=multilingual,
        alignment_heads=ct2.get("alignment_heads"), return_timestamps=False,
        **({"lang_to_id": {t: ids(t) for t in languages},
            "task_to_id": {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}}
           if multilingual else {}))
    # 4. save: model, processor (feature extractor + tokenizer), generation config
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=config.num_mel_bins), tokenizer)
    processor.save_pretrained(dst)
    return dst
