"""DecodeMirror: the running sequences' keys and values laid out densely for a CPU decode step, kept across steps.

The batched torch attention (paged_attention.py) gathers every sequence's whole blocks from the paged cache into a
padded [B, n * block_size] batch in every layer of every step: on a CPU that copy is the step's third cost after the
matmuls and the attention itself (the demo Llama, 16 sequences at ~300 tokens: 0.94 of 6.0 ms a step, profiled).
While the same sequences decode step after step, the gathered batch of one step is the next one's plus one new row
per sequence. The mirror keeps it: a step of the same sequences, each one token further, writes each layer's new
key and value into the mirror at its position; any other step (a sequence joined, left, was preempted, fed more
than one token, or outgrew the mirror) gathers afresh into a new one, with room to grow.

While it serves, the mirror is a write-back cache in front of the paged one: a step it continues writes its new keys
and values into the mirror only, and the paged cache receives them (`flush`, a few ops for any number of steps)
before anything reads it again: before the mirror is rebuilt or dropped, and at every step it does not continue
(the runner's prefill and mixed steps, block copies). It also keeps the step's attention mask, one more visible
key per sequence a step, so a continued step builds no layout. Attention sees the keys and values the gather would
read, bit for bit. It is bounded (`budget_bytes`): a batch whose mirror would be larger gathers every step, as
before. On CUDA the decode kernel reads the paged cache itself.
"""

from __future__ import annotations

import torch

from stages.llm.paged_attention import BatchedLayout

HEADROOM = 128  # positions a new mirror leaves for the steps after it, past the longest context
BUDGET_MB = 64  # the largest mirror kept (keys and values of every layer); a larger batch gathers every step


class DecodeMirror:
    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 budget_bytes: int = BUDGET_MB << 20):
        """`k_caches`, `v_caches`: the paged caches it stands in front of, per layer [blocks, block_size, Hkv, D]."""
        self.k_caches, self.v_caches = k_caches, v_caches
        self.num_layers = len(k_caches)
        self.budget_bytes = budget_bytes
        self.seq_ids: tuple[int, ...] = ()
        self.context_lens: list[int] = []
        self.keys: list[torch.Tensor | None] = []  # per layer [B, Hkv, capacity, D] (SDPA reads it faster than
        # [B, capacity, Hkv, D]: 266 against 330 us a layer, measured)
        self.values: list[torch.Tensor | None] = []
        self.capacity = 0
        self.fresh = False  # this step builds the mirror (each layer gathers into it); else it continues
        self.rows: torch.Tensor | None = None  # [B * Hkv] this step's row of each (sequence, kv head) in a layer
        # viewed [-1, D]
        self.bias: torch.Tensor | None = None  # [B, 1, 1, capacity] SDPA's additive mask: 0 up to each context
        self.newest: torch.Tensor | None = None  # [B] each sequence's newest key's entry in the flat mask
        self.query_rows: torch.Tensor | None = None  # [B, 1] the layout's packed query row of each sequence
        self.num_blocks = 0  # this step's key width in blocks (the gather's: ceil(longest context / block_size))
        self.block_size = 0
        # continued steps whose rows the paged cache lacks: their slots [B] and mirror rows [B * Hkv]
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin(self, seq_ids: tuple[int, ...], context_lens: list[int], slots: torch.Tensor, block_size: int,
              dtype: torch.dtype) -> bool:
        """A decode step of `seq_ids` at `context_lens` (this step's token included), their new tokens' paged
        `slots` [B]: whether the mirror serves it (else the step gathers as usual and the mirror is dropped)."""
        if self.continues(seq_ids, context_lens):
            self.advance(slots)
            return True
        self.flush()
        longest = max(context_lens)
        heads, dim = self.k_caches[0].shape[2:]
        capacity = -(-(longest + HEADROOM) // block_size) * block_size
        size = 2 * self.num_layers * len(seq_ids) * capacity * heads * dim * dtype.itemsize
        if size > self.budget_bytes:
            self.drop()
            return False
        self.seq_ids, self.capacity, self.fresh = seq_ids, capacity, True
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        count, device = len(seq_ids), slots.device
        lens = torch.tensor(context_lens, device=device)
        first = torch.arange(count * heads, device=device).view(count, heads) * capacity
        self.rows = (first + lens[:, None] - 1).view(-1)
        self.bias = torch.zeros(count, 1, 1, capacity, device=device).masked_fill_(
            torch.arange(capacity, device=device) >= lens[:, None, None, None], float("-inf"))
        self.newest = torch.arange(count, device=device) * capacity + lens - 1
        self.query_rows = torch.arange(count, device=device)[:, None]
        self.context_lens = list(context_lens)
        self.block_size, self.num_blocks = block_size, -(-longest // block_size)
        return True

    def continues(self, seq_ids: tuple[int, ...], context_lens: list[int]) -> bool:
        """Whether a decode step of `seq_ids` at `context_lens` continues the mirror: the same sequences, each one
        position further, within its capacity."""
        return seq_ids == self.seq_ids and max(context_lens) <= self.capacity and \
            all(now == before + 1 for now, before in zip(context_lens, self.context_lens))

    def advance(self, slots: torch.Tensor) -> None:
        """The step `continues` said it continues, its new tokens' paged `slots` [B]: every sequence is one position
        further, its rows move by one and its newest key turns visible in the mask."""
        assert self.rows is not None and self.newest is not None and self.bias is not None
        self.fresh = False
        self.rows, self.newest = self.rows + 1, self.newest + 1
        self.bias.view(-1).index_fill_(0, self.newest, 0.0)
        self.pending.append((slots, self.rows))  # (a fresh mirror's step writes the paged cache itself)
        self.context_lens = [n + 1 for n in self.context_lens]
        self.num_blocks = -(-max(self.context_lens) // self.block_size)

    def layout(self, block_tables: torch.Tensor) -> BatchedLayout:
        """A continued step's decode layout (no sliding window): the kept mask, as wide as the gather's."""
        assert self.bias is not None and self.query_rows is not None and not self.fresh
        return BatchedLayout(block_tables, self.num_blocks, self.query_rows, None, None, True,
                             self.bias[..., :self.num_blocks * self.block_size])

    def flush(self) -> None:
        """Write the continued steps' keys and values into the paged cache: one gather and one scatter a tensor."""
        if not self.pending:
            return
        slots = torch.cat([s for s, _ in self.pending])
        rows = torch.cat([r for _, r in self.pending])
        self.pending = []
        for mirrored, caches in ((self.keys, self.k_caches), (self.values, self.v_caches)):
            for layer, cache in zip(mirrored, caches):
                assert layer is not None
                flat = cache.view(-1, *cache.shape[2:])  # [slots, Hkv, D]
                flat.index_copy_(0, slots, layer.view(-1, cache.shape[-1]).index_select(0, rows).view(
                    -1, *cache.shape[2:]))

    def drop(self) -> None:
        self.flush()
        self.seq_ids, self.context_lens, self.capacity = (), [], 0
        self.keys, self.values = [], []

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, gather) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s mirror [B, Hkv, capacity, D] (keys, values) with this step's `key`/`value` [B, Hkv, D]
        in place; a fresh mirror first copies `gather()`'s keys and values [B, n * block_size, Hkv, D], which the
        paged cache gives with this step's row already written."""
        if self.fresh:
            k, v = gather()
            shape = (k.shape[0], k.shape[2], self.capacity, k.shape[3])
            keys, values = k.new_zeros(shape), v.new_zeros(shape)
            keys[:, :, :k.shape[1]], values[:, :, :v.shape[1]] = k.transpose(1, 2), v.transpose(1, 2)
            self.keys[layer], self.values[layer] = keys, values
            return keys, values
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None and self.rows is not None
        dim = keys.shape[-1]  # one index_copy_ per tensor: half the time of keys[b, :, position_b] = key
        keys.view(-1, dim).index_copy_(0, self.rows, key.reshape(-1, dim).to(keys.dtype))
        values.view(-1, dim).index_copy_(0, self.rows, value.reshape(-1, dim).to(values.dtype))
        return keys, values
