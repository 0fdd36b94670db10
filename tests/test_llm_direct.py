"""The direct decoder (stages/llm/direct.py) gives transformers' decoder forward bit for bit, for every model type it
serves (Llama; Mistral's sliding window; Qwen2's biases; Qwen3's q/k norms), on a packed step of two prefill chunks
and on the decode step after it, and the rows that sample to rounding where its last layer goes on with them alone;
other decoders are left to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from stages.llm import attention
from stages.llm.direct import DirectDecoder, Rotary, bare, short_mlp, short_norm

SERVED = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=6)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16)),
}
BLOCK = 4


def tiny(cls, config_cls, extra):
    config = config_cls(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128, **extra)
    config._attn_implementation = attention.register()
    torch.manual_seed(0)
    with torch.no_grad():
        model = cls(config).eval()
        for p in model.parameters():  # biases and norms away from their init, so each is used
            p.add_(torch.randn_like(p) * 0.05)
    return model


def metadata(caches, lengths: list[int], starts: list[int]) -> attention.PagedMetadata:
    """A packed step: sequence b feeds tokens [starts[b], starts[b] + lengths[b]), its blocks 8b, 8b + 1, ..."""
    k, v = caches
    tables = torch.arange(2 * 8).view(2, 8)
    slots = torch.cat([tables[b, pos // BLOCK] * BLOCK + pos % BLOCK
                       for b, pos in enumerate(torch.arange(s, s + n) for s, n in zip(starts, lengths))])
    q_lens = torch.tensor(lengths)
    return attention.PagedMetadata(
        k_caches=k, v_caches=v, slot_mapping=slots, query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long),
                                                                               q_lens.cumsum(0)]),
        context_lens=torch.tensor([s + n for s, n in zip(starts, lengths)]), block_tables=tables,
        all_decode=all(n == 1 for n in lengths), max_query_len=max(lengths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(SERVED))
@torch.inference_mode()
def test_the_direct_decoder_equals_transformers_bit_for_bit(arch, dtype):
    model = tiny(*SERVED[arch]).to(dtype)
    decoder = model.model
    assert DirectDecoder.serves(decoder)
    direct = DirectDecoder(decoder)
    # the short forms are the ones compared: the rotation in 4 ops a tensor, the MLP and the linear layers without
    # their module calls, torch's rms_norm for float32's norms
    layer = decoder.layers[0]
    assert direct.rotary.exact and short_mlp(layer.mlp) and bare(layer.self_attn.q_proj)
    row = torch.zeros(1, model.config.hidden_size, dtype=dtype)
    assert short_norm(layer.input_layernorm, row) == (dtype == torch.float32)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (16, BLOCK, config.num_key_value_heads, head_dim)

    def caches():
        return tuple([torch.zeros(shape, dtype=dtype) for _ in range(2)] for _ in range(2))

    ours, theirs = caches(), caches()
    gen = torch.Generator().manual_seed(1)
    for lengths, starts in (([9, 5], [0, 0]), ([1, 1], [9, 5]), ([3, 1], [10, 6])):  # prefill, decode, mixed
        ids = torch.randint(0, 100, (sum(lengths),), generator=gen)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        got = direct(ids, positions, metadata(ours, lengths, starts))
        want = decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                       paged=metadata(theirs, lengths, starts)).last_hidden_state[0]
        assert torch.equal(got, want), f"{arch}: {(got - want).abs().max()}"
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert torch.equal(a, b)  # the same keys and values written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(SERVED))
@torch.inference_mode()
def test_the_last_layer_goes_on_with_the_rows_that_sample(arch, dtype):
    """With `sampled` (the rows that sample and their decode-row metadata, as the runner makes them for a prefill or
    a mixed step) the last layer's queries, attention, output projection and MLP run for those rows alone; their
    hidden states are the full forward's to rounding, and every row's key and value is written, bit for bit."""
    model = tiny(*SERVED[arch]).to(dtype)
    direct = DirectDecoder(model.model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (16, BLOCK, config.num_key_value_heads, head_dim)
    full_caches, sampled_caches = (tuple([torch.zeros(shape, dtype=dtype) for _ in range(2)] for _ in range(2))
                                   for _ in range(2))
    rows_seen: list[int] = []
    hook = model.model.layers[-1].mlp.register_forward_pre_hook(lambda module, args: rows_seen.append(len(args[0])))
    gen = torch.Generator().manual_seed(2)
    for lengths, starts in (([9, 5], [0, 0]), ([3, 1], [9, 5]), ([20, 1], [0, 6])):  # prefills; a chunk and a decode
        ids = torch.randint(0, 100, (sum(lengths),), generator=gen)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        full = direct(ids, positions, metadata(full_caches, lengths, starts))
        meta = metadata(sampled_caches, lengths, starts)
        last = torch.tensor(lengths).cumsum(0) - 1
        tail = attention.PagedMetadata(
            k_caches=sampled_caches[0], v_caches=sampled_caches[1], slot_mapping=meta.slot_mapping[last],
            query_start_loc=torch.arange(3), context_lens=meta.context_lens, block_tables=meta.block_tables,
            all_decode=True, max_query_len=1, max_context_len=int(meta.context_lens.max()))
        got = direct(ids, positions, meta, (last, tail))
        assert rows_seen[-2:] == [sum(lengths), 2]  # the full forward's last MLP, then the sampled one's
        torch.testing.assert_close(got, full[last])
    hook.remove()
    for a, b in zip(full_caches[0] + full_caches[1], sampled_caches[0] + sampled_caches[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_rotation_table_equals_the_embedding_of_each_step_and_grows(dtype):
    """The cos and sin read from the table are the ones the model's rotary embedding gives the step's positions
    itself, bit for bit, also after a step past the table made it grow; a rotation that depends on the length
    (dynamic NTK) is computed each step."""
    model = tiny(*SERVED["llama"]).to(dtype)
    direct = DirectDecoder(model.model)
    hidden = torch.zeros(3, model.config.hidden_size, dtype=dtype)
    for positions in ([0, 5, 1023], [1500, 7, 3000]):  # the second reaches past the first table
        pos = torch.tensor(positions)
        got = direct._cos_sin(hidden, pos, None)
        cos, sin = model.model.rotary_emb(hidden[None], pos[None])
        assert all(torch.equal(a, b) for a, b in zip(got, direct.rotary.prepare(cos[0], sin[0])))
    assert direct.table is not None and direct.table[0].shape[0] > 3000
    dynamic = tiny(*SERVED["llama"][:2], dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 10000.0}))
    assert not DirectDecoder(dynamic.model).tabled


def test_other_decoders_go_through_transformers():
    gemma = tiny(GemmaForCausalLM, GemmaConfig, dict(head_dim=16))
    assert not DirectDecoder.serves(gemma.model)


def test_a_model_with_another_rotation_keeps_its_own():
    """The short rotation is taken only where the model's own function gives its result: GPT-J's interleaved
    pairs do not, so such a model keeps its function."""
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rotate(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    assert not Rotary(interleaved, torch.float32).exact


@torch.inference_mode()
def test_a_hooked_or_patched_module_is_still_called():
    """A layer with a forward hook (how LoRA rows and offloading attach), a forward patched onto it after the
    decoder is built (use_fused_norms' Triton norms) or a global hook runs as a module call: what it adds is in the
    result."""
    model = tiny(*SERVED["llama"])
    decoder = model.model
    direct = DirectDecoder(decoder)
    shape = (16, BLOCK, model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads)
    ids, positions = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 1, 2, 0, 1])

    def run() -> torch.Tensor:
        caches = tuple([torch.zeros(shape) for _ in range(2)] for _ in range(2))
        return direct(ids, positions, metadata(caches, [3, 2], [0, 0]))

    plain = run()
    layer = decoder.layers[0]
    handle = layer.self_attn.o_proj.register_forward_hook(lambda module, args, out: out + 1)
    assert not bare(layer.self_attn.o_proj) and not torch.equal(run(), plain)
    handle.remove()
    for module in (layer.mlp, layer.input_layernorm):
        module.forward = lambda x: torch.zeros_like(x)
        assert not bare(module) and not torch.equal(run(), plain)
        del module.forward
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert not bare(layer.self_attn.q_proj)
    finally:
        handle.remove()
    assert torch.equal(run(), plain)
