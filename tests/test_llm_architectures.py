"""Any transformers decoder LM runs on the paged engine: greedy output equals generate() for tiny
Mistral (sliding window), Gemma, Gemma 2 (logit soft-capping, sliding window), Phi-3 and Qwen3."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipelines.chat import ChatRequest, LLMConfig
from pipelines.demo.llm import chat_tokenizer
from stages.llm.params import SamplingParams
from tests.helpers import running_engine

ARCHS = {
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=8)),
    "gemma": (GemmaForCausalLM, GemmaConfig, dict(head_dim=16)),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(head_dim=16, sliding_window=8, attn_logit_softcapping=50.0,
                                                      final_logit_softcapping=30.0)),
    "phi3": (Phi3ForCausalLM, Phi3Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_equals_generate(arch, tmp_path):
    cls, config_cls, extra = ARCHS[arch]
    tok = chat_tokenizer()
    config = config_cls(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                        eos_token_id=tok.eos_token_id, pad_token_id=0, bos_token_id=None, **extra)
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ids = tok("The quick brown fox jumps over the lazy dog and the serving engine batches requests").input_ids
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    # Small blocks and a 16-token budget: the prompt is prefilled in two chunks.
    llm = LLMConfig(kv_cache_mb=4, block_size=4, max_num_batched_tokens=16)
    with running_engine(str(tmp_path), llm=llm) as engine:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        out = engine.submit_chat("m", ChatRequest(prompt=ids, params=params)).result(timeout=120)
    assert out["choices"][0]["token_ids"] == want
