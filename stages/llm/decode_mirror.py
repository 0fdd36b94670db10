"""DecodeMirror: the running sequences' keys and values laid out densely for a CPU decode step, kept across steps.

The batched torch attention (paged_attention.py) gathers every sequence's whole blocks from the paged cache into a
padded [B, n * block_size] batch in every layer of every step: on a CPU that copy is the step's third cost after the
matmuls and the attention itself (the demo Llama, 16 sequences at ~300 tokens: 0.94 of 6.0 ms a step, profiled).
While the same sequences decode step after step, the gathered batch of one step is the next one's plus one new row
per sequence. The mirror keeps it: a step of the same sequences, each one token further, writes each layer's new
key and value into the mirror at its position; any other step (a sequence joined, left, was preempted, fed more
than one token, or outgrew the mirror) gathers afresh into a new one, with room to grow.

The paged cache stays the record (the KV write happens as before); the mirror is a copy of what the gather would
read, so attention sees the same keys and values, bit for bit. It is bounded (`budget_bytes`): a batch whose mirror
would be larger gathers every step, as before. On CUDA the decode kernel reads the paged cache itself.
"""

from __future__ import annotations

import torch

HEADROOM = 128  # positions a new mirror leaves for the steps after it, past the longest context
BUDGET_MB = 64  # the largest mirror kept (keys and values of every layer); a larger batch gathers every step


class DecodeMirror:
    def __init__(self, num_layers: int, budget_bytes: int = BUDGET_MB << 20):
        self.num_layers = num_layers
        self.budget_bytes = budget_bytes
        self.seq_ids: tuple[int, ...] = ()
        self.context_lens: list[int] = []
        self.keys: list[torch.Tensor | None] = []  # per layer [B, Hkv, capacity, D] (SDPA reads it faster than
        # [B, capacity, Hkv, D]: 266 against 330 us a layer, measured)
        self.values: list[torch.Tensor | None] = []
        self.capacity = 0
        self.fresh = False  # this step builds the mirror (each layer gathers into it)
        self.heads: torch.Tensor | None = None  # [B, Hkv] the first row of each (sequence, kv head) in a flat layer
        self.rows: torch.Tensor | None = None  # [B * Hkv] this step's row of each in a layer viewed [-1, D]

    def begin(self, seq_ids: tuple[int, ...], context_lens: list[int], block_size: int, kv_shape: tuple[int, int],
              dtype: torch.dtype, device: torch.device) -> bool:
        """A decode step of `seq_ids` at `context_lens` (this step's token included): whether the mirror serves it
        (else the step gathers as usual and the mirror is dropped)."""
        longest = max(context_lens)
        if seq_ids == self.seq_ids and longest <= self.capacity and \
                all(now == before + 1 for now, before in zip(context_lens, self.context_lens)):
            self.fresh = False
        else:
            capacity = -(-(longest + HEADROOM) // block_size) * block_size
            heads, dim = kv_shape
            size = 2 * self.num_layers * len(seq_ids) * capacity * heads * dim * dtype.itemsize
            if size > self.budget_bytes:
                self.drop()
                return False
            self.seq_ids, self.capacity, self.fresh = seq_ids, capacity, True
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
            self.heads = torch.arange(len(seq_ids) * heads, device=device).view(len(seq_ids), heads) * capacity
        self.context_lens = list(context_lens)
        assert self.heads is not None
        self.rows = (self.heads + torch.tensor(context_lens, device=device)[:, None] - 1).view(-1)
        return True

    def drop(self) -> None:
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
