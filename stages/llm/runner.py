"""ModelRunner: a transformers causal LM, its paged KV tensors, and one forward per Plan (execution only).

A vision-language model passes its already-loaded model, its language decoder and whether it uses
M-RoPE: the runner then embeds the prompt itself and splices the media features in (multimodal.py).
"""

from __future__ import annotations

import array
import contextlib
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from stages.cuda_graph_metrics import GraphObserver
from stages.cuda_graphs import GraphConfig, GraphRunner
from stages.llm import attention
from stages.llm.decode_mirror import DecodeMirror
from stages.llm.direct import DirectDecoder, linear
from stages.llm.multimodal import mrope_positions, splice
from stages.llm.scheduler import Plan
from stages.llm.sequence import Sequence
from stages.lora import AdapterGate, LoraSlots, rows_use, slots_use

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers: 2 * layers * block_size * Hkv * D * bytes."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class ModelRunner:
    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32", block_size: int = 16,
                 kv_cache_mb: float = 256, num_blocks: int | None = None, model=None, decoder=None,
                 mrope: bool = False, graphs: GraphConfig = GraphConfig(), observer: GraphObserver | None = None,
                 name: str = "llm"):
        """`model`: an already-loaded model whose language part uses the paged attention (a VLM), with
        `decoder` its language model (embeddings in, hidden states out); `mrope`: 3-D positions.
        `graphs`: decode row buckets replayed from graphs captured by `capture_graphs` (plain LMs)."""
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype,
                                                         attn_implementation=attention.register())
            model.to(self.device).eval()
        self.model = model
        self.decoder = decoder if decoder is not None else getattr(model, model.base_model_prefix)
        self.mrope = mrope
        # a plain LM with Llama's layers runs them directly (stages/llm/direct.py); others through transformers
        self.direct = DirectDecoder(self.decoder) if decoder is None and not mrope and \
            DirectDecoder.serves(self.decoder) else None
        self.adapters = AdapterGate()  # a served model's Adapters registry replaces it (pipelines/adapters.py)
        self.lora_slots: LoraSlots | None = None  # enable_lora_slots: adapters inside the decode graphs
        config = self.model.config.get_text_config()
        self.config = config
        heads = config.num_attention_heads
        self.kv = KVShape(num_layers=config.num_hidden_layers,
                          num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                          head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                          block_size=block_size, dtype=self.dtype)
        # Sized from the memory budget unless given: the block count is a start-up measurement.
        self.num_blocks = num_blocks or max(1, int(kv_cache_mb * 2**20) // self.kv.block_bytes)
        # With graphs, one extra block that no sequence owns: padding rows of a bucket write their K/V there.
        scratch = 1 if graphs.enabled and not mrope and decoder is None else 0
        shape = (self.num_blocks + scratch, block_size, self.kv.num_kv_heads, self.kv.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.kv.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.kv.num_layers)]
        self.max_context = getattr(config, "max_position_embeddings", None) or 2048
        head = self.model.get_output_embeddings()
        self.vocab_size = head.weight.shape[0]
        # where the head sits, read by name each step (an adapter may wrap it later): the method is a walk
        self._head_name = next((name for name, module in self.model.named_children() if module is head), None)
        self.soft_cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2's, read once
        self.hidden_size = config.hidden_size
        self.decode_graphs = None
        # CPU decode steps of the same sequences keep their keys and values laid out (stages/llm/decode_mirror.py)
        self.mirror = DecodeMirror(self.k_caches, self.v_caches) if self.device.type == "cpu" else None
        if scratch:
            self.table_width = -(-self.max_context // block_size)  # static block-table columns
            pads = {"input_ids": 0, "positions": 0, "slot_mapping": self.num_blocks * block_size, "context_lens": 0,
                    "block_tables": 0}
            self.decode_graphs = GraphRunner(f"{name}/decode", self._decode_forward, graphs, pad_values=pads,
                                             observer=observer)
        # decode steps of the same sequences may run without a plan (continue_decode): a CPU runner whose layers
        # run directly with no sliding window (whose layers would build a layout), no decode graphs
        self.plan_free = self.mirror is not None and self.direct is not None and self.direct.windowless and \
            self.decode_graphs is None

    def execute(self, plan: Plan) -> torch.Tensor:
        """Run the plan's chunks as one packed forward; return float32 logits [rows that sample, V]. The forward
        holds the model's adapter gate (adapters load and unload between forwards)."""
        with self.adapters.using([name for c in plan.chunks for name, _ in c.seq.lora]):
            return self._execute(plan)

    @torch.inference_mode()
    def _execute(self, plan: Plan) -> torch.Tensor:
        chunks = plan.chunks
        if self.decode_graphs is not None and all(len(c.token_ids) == 1 and c.sample and not c.seq.media
                                                  and c.seq.hidden is None
                                                  and (not c.seq.lora or self.lora_slots is not None)
                                                  for c in chunks):
            self._copy_blocks(plan.copies)
            return self.decode_graphs(self._decode_inputs(chunks))
        dev = self.device
        # the step's metadata from host lists, in one tensor made at once (one copy to a device; no per-sequence
        # tensors, no reads back): token ids, positions, slots, query starts, context lengths, block tables
        ids: list[int] = []
        positions_: list[int] = []
        slots: list[int] = []
        ends = [0]
        context_lens: list[int] = []
        for c in chunks:
            ids += c.token_ids
            slots += c.slots
            end = c.context_len
            positions_ += range(c.start, end)
            ends.append(ends[-1] + len(c.token_ids))
            context_lens.append(end)
        longest = max(len(c.token_ids) for c in chunks)
        width = max(len(c.block_ids) for c in chunks)
        tables = [b for c in chunks for b in (*c.block_ids, *(0,) * (width - len(c.block_ids)))]
        count = len(chunks)
        input_ids, positions, slot_mapping, query_start_loc, context_lens_t, block_tables = self._tensors(
            ids, positions_, slots, ends, context_lens, tables)
        meta = attention.PagedMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches, slot_mapping=slot_mapping, slots_valid=min(slots) >= 0,
            query_start_loc=query_start_loc, context_lens=context_lens_t, block_tables=block_tables.view(count, width),
            all_decode=longest == 1, max_query_len=longest, max_context_len=max(context_lens))
        if self.mirror is not None:
            if meta.all_decode and meta.slots_valid and not plan.copies and self.mirror.begin(
                    tuple(c.seq.seq_id for c in chunks), context_lens, slot_mapping, self.kv.block_size, self.dtype):
                meta.mirror = self.mirror
            else:  # any other step reads the paged cache: the rows the mirror kept go there first
                self.mirror.flush()
        self._copy_blocks(plan.copies)
        inputs = {"input_ids": input_ids[None]}
        if any(c.seq.media for c in chunks):  # embed, then splice each chunk's slice of its media features
            embeds = self.model.get_input_embeddings()(input_ids)  # [T, H]
            row = 0
            for c in chunks:
                splice(embeds, row, c.start, c.context_len, c.seq.media)
                row += len(c.token_ids)
            inputs = {"inputs_embeds": embeds[None]}
        if self.mrope:  # [3, 1, T]: temporal, height, width positions
            positions = torch.cat([mrope_positions(c.seq.mrope, c.start, c.context_len) for c in chunks],
                                  dim=1)[:, None].to(dev)
        else:
            positions = positions[None]
        adapted = any(c.seq.lora for c in chunks)  # then each token runs with its request's adapters
        last = [end - 1 for end, c in zip(ends[1:], chunks) if c.sample]
        kept = any(c.seq.hidden is not None for c in chunks)
        with rows_use([c.seq.lora for c in chunks for _ in c.token_ids] if adapted else ()):
            if self.direct is not None and "input_ids" in inputs:
                # a prefill's last layer goes on with the rows that sample alone (not with adapters: they select
                # by row; nor where a sequence keeps every row's hidden state)
                sampled = None if len(last) in (0, len(ids)) or adapted or kept else self._sampled(
                    chunks, last, meta, block_tables.view(count, width))
                hidden = self.direct(input_ids, positions[0], meta, sampled)  # [T or sampling rows, H]
            else:
                hidden = self.decoder(**inputs, position_ids=positions, use_cache=False,
                                      paged=meta).last_hidden_state[0]
        row = 0
        for c in chunks:  # sequences that keep their hidden states (a speech decoder reads them); a re-prefill
            if c.seq.hidden is not None:  # after preemption overwrites from its start
                del c.seq.hidden[c.start:]
                c.seq.hidden.extend(hidden[row:row + len(c.token_ids)].float().cpu().unbind(0))
            row += len(c.token_ids)
        if len(last) < hidden.shape[0]:  # (every row samples in a decode step; `sampled`: only those rows came)
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=dev)]
        return self._logits(hidden)

    def _sampled(self, chunks, last: list[int], meta: attention.PagedMetadata, tables: torch.Tensor):
        """The packed rows that sample and their metadata as decode rows (each the last of its chunk, attending to
        its whole context): what a prefill's last layer needs (DirectDecoder)."""
        which = [i for i, c in enumerate(chunks) if c.sample]
        rows, index = self._tensors(last, which)
        return rows, attention.PagedMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches, slot_mapping=meta.slot_mapping[rows],
            slots_valid=meta.slots_valid, query_start_loc=torch.arange(len(last) + 1, device=self.device),
            context_lens=meta.context_lens[index], block_tables=tables[index], all_decode=True, max_query_len=1,
            max_context_len=max(chunks[i].context_len for i in which))

    def continues(self, seqs: list[Sequence]) -> bool:
        """Whether the decode step of `seqs` (Scheduler.decoding: each one token further) may run as
        `continue_decode`: plain token sequences (`plan_free` runner), the same ones the mirror holds, each one
        position further."""
        assert self.mirror is not None
        return all(not (seq.lora or seq.media or seq.hidden is not None) for seq in seqs) and \
            self.mirror.continues(tuple(seq.seq_id for seq in seqs), [seq.num_computed_tokens + 1 for seq in seqs])

    @torch.inference_mode()
    def continue_decode(self, seqs: list[Sequence], slots: list[int]) -> torch.Tensor:
        """`execute` of the decode step `continues` accepted, without a Plan: each sequence's next token at its
        next position into `slots`, attended from the mirror (no block table, no layout); float32 logits [B, V]."""
        count = len(seqs)
        positions_ = [seq.num_computed_tokens for seq in seqs]
        ids = [seq.tokens[position] for seq, position in zip(seqs, positions_)]
        context_lens = [position + 1 for position in positions_]
        input_ids, positions, slot_mapping, context_lens_t = self._tensors(ids, positions_, slots, context_lens)
        assert self.mirror is not None and self.direct is not None
        self.mirror.advance(slot_mapping)
        meta = attention.PagedMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches, slot_mapping=slot_mapping, slots_valid=True,
            query_start_loc=torch.arange(count + 1, device=self.device), context_lens=context_lens_t,
            block_tables=torch.empty(count, 0, dtype=torch.long, device=self.device),  # (the mirror's keys: none read)
            all_decode=True, max_query_len=1, max_context_len=max(context_lens), mirror=self.mirror)
        with self.adapters.using(()):
            return self._logits(self.direct(input_ids, positions, meta))

    def _tensors(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """The step's integer lists as int64 tensors on the device, made at once: one array, one copy (torch.tensor
        of a list converts element by element, 3.5x slower at a decode step's ~450 numbers)."""
        flat: list[int] = []
        for numbers in lists:
            flat += numbers
        host = torch.frombuffer(array.array("q", flat), dtype=torch.long)
        return host.to(self.device).split([len(numbers) for numbers in lists])

    def _copy_blocks(self, copies) -> None:
        for src, dst in copies:  # copy-on-write of shared partial blocks, before anyone writes them
            for cache in (*self.k_caches, *self.v_caches):
                cache[dst].copy_(cache[src])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over hidden states [rows, H]: float32 logits [rows, V], soft-capped where the model does."""
        head = getattr(self.model, self._head_name) if self._head_name else self.model.get_output_embeddings()
        logits = linear(head, hidden).float()
        cap = self.soft_cap
        return torch.tanh(logits / cap) * cap if cap else logits

    # -- decode through the graph runner ------------------------------------------------------
    def _decode_inputs(self, chunks) -> dict[str, torch.Tensor]:
        """One row per sequence; block tables padded to the static width."""
        dev = self.device
        tables = torch.zeros(len(chunks), self.table_width, dtype=torch.long)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.long)
        inputs = {"input_ids": torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long, device=dev),
                  "positions": torch.tensor([c.start for c in chunks], dtype=torch.long, device=dev),
                  "slot_mapping": torch.tensor([c.slots[0] for c in chunks], dtype=torch.long, device=dev),
                  "context_lens": torch.tensor([c.context_len for c in chunks], dtype=torch.long, device=dev),
                  "block_tables": tables.to(dev)}
        if self.lora_slots is not None:  # every row's adapter slots, LoRA or not: one graph for every mix
            inputs["lora_slots"], inputs["lora_weights"] = self.lora_slots.plan([c.seq.lora for c in chunks], dev)
        return inputs

    def enable_lora_slots(self, slots: LoraSlots) -> None:
        """Decode steps with adapters replay the captured graphs too: adapters live in `slots` (stages/lora.py),
        and every decode graph takes each row's slots and weights as inputs."""
        self.lora_slots = slots
        if self.decode_graphs is not None:
            self.decode_graphs.pad_values = {**self.decode_graphs.pad_values, "lora_slots": 0, "lora_weights": 0.0}

    def _decode_forward(self, input_ids, positions, slot_mapping, context_lens, block_tables, lora_slots=None,
                        lora_weights=None) -> torch.Tensor:
        """A pure-decode step over static inputs (what a graph captures): float32 logits [rows, V]."""
        rows = input_ids.shape[0]
        meta = attention.PagedMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches, slot_mapping=slot_mapping,
            query_start_loc=torch.arange(rows + 1, dtype=torch.long, device=input_ids.device),
            context_lens=context_lens, block_tables=block_tables, all_decode=True, slots_valid=True)
        slotted = contextlib.nullcontext() if lora_slots is None else slots_use(lora_slots, lora_weights)
        with slotted:
            hidden = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                  paged=meta).last_hidden_state[0]  # [rows, H]
        return self._logits(hidden)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Warm-up: capture every decode bucket from one padding row, then seal (no capture while serving)."""
        if self.decode_graphs is None or self.decode_graphs.sealed:
            return
        pads = self.decode_graphs.pad_values
        row = {name: torch.full((1,), value, dtype=torch.long, device=self.device) for name, value in pads.items()
               if name not in ("block_tables", "lora_slots", "lora_weights")}
        row["block_tables"] = torch.zeros(1, self.table_width, dtype=torch.long, device=self.device)
        if self.lora_slots is not None:
            row["lora_slots"], row["lora_weights"] = self.lora_slots.plan([()], self.device)
        self.decode_graphs(row)
        self.decode_graphs.seal()

