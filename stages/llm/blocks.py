"""BlockManager: paged-KV bookkeeping (block ids, reference counts, prefix cache). No tensors.

The model runner owns the KV tensors; this file only decides which physical block holds which
logical block and returns copy-on-write instructions `(src, dst)` for the runner to apply.

Every physical block is in exactly one of three states:

* free:      refcount 0, not in the prefix cache (`_free`, FIFO)
* cached:    refcount 0, in the prefix cache, evictable (`_evictable`, least recently freed first)
* used:      refcount > 0 (may also be in the prefix cache)

Prefix caching works on FULL blocks only. A block is keyed by a hash chain over
(namespace, parent block hash, the block's token ids) and becomes reusable only after
`mark_computed` says its KV is written: registering at allocation time would let another request
hit a block a chunked prefill has not computed yet, or one a cancelled prefill never wrote.
A hash hit is verified against the stored namespace, token ids and the identity of the parent
entry, so a hash collision, at any depth of the chain, is a miss and never wrong KV.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

_ROOT_UID = 0  # parent identity of a sequence's first block


def block_hash(namespace: Hashable, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of one full block. Module-level so tests can force collisions by patching it."""
    return hash((namespace, parent_hash, token_ids))


class OutOfBlocksError(RuntimeError):
    """Raised by allocate/append when the pool cannot satisfy them; check can_allocate/can_append first."""


@dataclass
class BlockTable:
    """One sequence's view of its KV; owned by the sequence, mutated only by BlockManager."""

    block_ids: list[int] = field(default_factory=list)  # physical block per logical block
    num_tokens: int = 0  # tokens whose KV slots are assigned
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at allocation
    namespace: Hashable = None  # prefix-cache identity (weights, adapter, tenant), set by allocate
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each leading full, computed block
    block_uids: list[int] = field(default_factory=list)  # cache-entry identity of those blocks (parent check)


@dataclass(frozen=True)
class _CacheEntry:
    block_hash: int  # chain hash the entry is filed under
    namespace: Hashable  # compared on a hit: no cross-tenant reuse even if hashes collide
    parent_uid: int  # identity of the previous block's entry: verifies the whole prefix, not one block
    token_ids: tuple[int, ...]  # compared on a hit (full-token verification)
    uid: int  # unique per registration; a re-registered block gets a new one

    def matches(self, namespace: Hashable, parent_uid: int, token_ids: tuple[int, ...]) -> bool:
        """Full verification of a hash hit: same tenant/model, same prefix, same tokens."""
        return (self.namespace, self.parent_uid, self.token_ids) == (namespace, parent_uid, token_ids)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up by allocate
    hits: int = 0  # of those, tokens served from the cache
    evictions: int = 0  # cached blocks dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.stats = PrefixCacheStats()
        self._refcount = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._entries: dict[int, _CacheEntry] = {}  # block id -> its cache entry (registered blocks only)
        self._by_hash: dict[int, int] = {}  # chain hash -> block id; one block per hash, first writer wins
        self._next_uid = _ROOT_UID  # registrations count up from here

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones plus unreferenced cached ones (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix hits (a subset of num_free_blocks)."""
        return len(self._evictable)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------------
    def can_allocate(self, token_ids: list[int], namespace: Hashable) -> bool:
        """Whether allocate would succeed now, counting prefix hits (a hit on an evictable block
        revives it, so it stops counting as free)."""
        hits = self._match_prefix(token_ids, namespace)
        revived = sum(1 for block_id, _, _ in hits if self._refcount[block_id] == 0)
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        return fresh <= self.num_free_blocks - revived

    def allocate(self, table: BlockTable, token_ids: list[int], namespace: Hashable) -> None:
        """Assign slots for every token of `token_ids` (a prompt, or prompt + outputs on resume).

        Leading full blocks found in the prefix cache are shared (refcount + 1). At least one token
        is always left to compute, because sampling needs the last prompt token's logits: cached
        tokens are capped at len(token_ids) - 1 rounded down to a block boundary.
        """
        if table.block_ids or table.num_tokens:
            raise ValueError("allocate needs an empty BlockTable; free it first or use append")
        if not token_ids:
            raise ValueError("token_ids must hold at least one token")
        if not self.can_allocate(token_ids, namespace):
            raise OutOfBlocksError(f"{len(token_ids)} tokens need more than the {self.num_free_blocks} free "
                                   "blocks; check can_allocate first")
        hits = self._match_prefix(token_ids, namespace)
        # Revive hits before taking fresh blocks, so a fresh block can never evict a hit.
        for block_id, _, _ in hits:
            self._ref(block_id)
        table.block_ids = [block_id for block_id, _, _ in hits]
        table.block_hashes = [h for _, h, _ in hits]
        table.block_uids = [uid for _, _, uid in hits]
        missing = self.blocks_needed(len(token_ids)) - len(hits)
        table.block_ids += [self._take_block() for _ in range(missing)]
        table.namespace = namespace
        table.num_tokens = len(token_ids)
        table.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_cache:
            self.stats.queries += len(token_ids)
            self.stats.hits += table.num_cached_tokens

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self._append_cost(table, num_new_tokens) <= self.num_free_blocks

    def append(self, table: BlockTable, token_ids: Sequence[int], num_new_tokens: int) -> list[tuple[int, int]]:
        """Assign `num_new_tokens` more slots; return the (src, dst) block copies the runner must
        apply before writing them.

        `token_ids` is the sequence's full token list, checked to cover the new slots; blocks are
        registered in the prefix cache by `mark_computed`, once their KV is written.
        Copy-on-write: if the partial last block is shared (refcount > 1), this table moves to a
        private copy and the other holders keep the original.
        """
        if not table.block_ids:
            raise ValueError("append needs an allocated BlockTable; call allocate first")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if len(token_ids) < table.num_tokens + num_new_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} tokens; the table needs "
                             f"{table.num_tokens + num_new_tokens} after appending {num_new_tokens}")
        if not self.can_append(table, num_new_tokens):
            raise OutOfBlocksError(f"appending {num_new_tokens} tokens needs more than the "
                                   f"{self.num_free_blocks} free blocks")
        copies: list[tuple[int, int]] = []
        if num_new_tokens == 0:
            return copies
        if self._tail_is_shared(table):
            src = table.block_ids[-1]
            dst = self._take_block()
            self._refcount[src] -= 1  # still >= 1: the other holders keep it
            table.block_ids[-1] = dst
            copies.append((src, dst))
        table.num_tokens += num_new_tokens
        missing = self.blocks_needed(table.num_tokens) - len(table.block_ids)
        table.block_ids += [self._take_block() for _ in range(missing)]
        return copies

    def append_slot(self, table: BlockTable, position: int) -> int | None:
        """`append` of one slot for `position` where that is all it does (most steps of a decoding sequence): the
        table's next position, inside its last block, which it holds alone. Returns the position's slot, or None
        where `append` must decide (a new block, a copy-on-write, a slot assigned already)."""
        if not self.appends_in_place(table, position):
            return None
        table.num_tokens += 1
        return table.block_ids[-1] * self.block_size + position % self.block_size

    def appends_in_place(self, table: BlockTable, position: int) -> bool:
        """Whether `append_slot(table, position)` gives a slot (and changes nothing but the table's count)."""
        return position == table.num_tokens and position % self.block_size != 0 and \
            self._refcount[table.block_ids[-1]] == 1

    def fork(self, parent: BlockTable, child: BlockTable) -> None:
        """n > 1: the child shares every parent block (refcount + 1).

        Fork only when all assigned slots are computed (num_computed == num_tokens): slots assigned
        but not yet written sit in shared blocks, and both holders would write them in place.
        """
        if not parent.block_ids:
            raise ValueError("fork needs an allocated parent BlockTable")
        if child.block_ids or child.num_tokens:
            raise ValueError("fork needs an empty child BlockTable")
        for block_id in parent.block_ids:
            self._ref(block_id)
        child.block_ids = list(parent.block_ids)
        child.num_tokens = parent.num_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.namespace = parent.namespace
        child.block_hashes = list(parent.block_hashes)
        child.block_uids = list(parent.block_uids)

    def free(self, table: BlockTable) -> None:
        """Release the table's references and empty it; a second call is a no-op.

        Blocks are released tail first, so a cached prefix's later blocks become older in the LRU
        and are evicted before the earlier blocks every longer match depends on.
        Never free a copy of a table (e.g. a launch snapshot): only the owner's table.
        """
        for block_id in reversed(table.block_ids):
            assert self._refcount[block_id] > 0, f"block {block_id} released more often than referenced"
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                if block_id in self._entries:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        table.block_ids = []
        table.num_tokens = 0
        table.num_cached_tokens = 0
        table.block_hashes = []
        table.block_uids = []

    def slot_mapping(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Physical slot (block_id * block_size + offset) of each position in [start, end)."""
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"positions [{start}, {end}) must lie within [0, {table.num_tokens}] (assigned slots)")
        size = self.block_size
        return [table.block_ids[p // size] * size + p % size for p in range(start, end)]

    # -- prefix cache ---------------------------------------------------------------------------
    def mark_computed(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int,
                      namespace: Hashable | None = None) -> None:
        """Register the table's full blocks whose KV is now written (positions < num_computed_tokens).

        Call after the forward that wrote them completed. `namespace`, when given, must be the one
        the table was allocated under.
        """
        if namespace is not None and namespace != table.namespace:
            raise ValueError(f"namespace {namespace!r} differs from the table's {table.namespace!r}")
        if not 0 <= num_computed_tokens <= min(table.num_tokens, len(token_ids)):
            raise ValueError(f"num_computed_tokens must be in [0, {min(table.num_tokens, len(token_ids))}] "
                             f"(assigned slots and known tokens), got {num_computed_tokens}")
        if not self.enable_prefix_cache:
            return
        size = self.block_size
        for i in range(len(table.block_hashes), num_computed_tokens // size):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            parent_hash = table.block_hashes[-1] if table.block_hashes else None
            parent_uid = table.block_uids[-1] if table.block_uids else _ROOT_UID
            h = block_hash(table.namespace, parent_hash, tokens)
            table.block_hashes.append(h)
            table.block_uids.append(self._register(table.block_ids[i], h, table.namespace, parent_uid, tokens))

    def invalidate(self, namespace_predicate: Callable[[Hashable], bool]) -> int:
        """Drop every cache entry whose namespace matches (a model or adapter reload); return how many.

        Unreferenced ones become free; referenced ones stay with their holders but can no longer hit.
        """
        dropped = [b for b, entry in self._entries.items() if namespace_predicate(entry.namespace)]
        for block_id in dropped:
            entry = self._entries.pop(block_id)
            del self._by_hash[entry.block_hash]
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._free.append(block_id)
        return len(dropped)

    def reset_prefix_cache(self) -> int:
        return self.invalidate(lambda namespace: True)

    def check_invariants(self) -> None:
        """Internal consistency (tests and debugging): every block in exactly one state."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for block_id, count in enumerate(self._refcount):
            assert count >= 0
            assert (count == 0) == (block_id in free or block_id in evictable), block_id
        assert evictable <= self._entries.keys() and not free & self._entries.keys()
        assert {self._by_hash[e.block_hash] for e in self._entries.values()} == self._entries.keys()
        assert len(self._by_hash) == len(self._entries)

    # -- internals ------------------------------------------------------------------------------
    def _match_prefix(self, token_ids: list[int], namespace: Hashable) -> list[tuple[int, int, int]]:
        """Leading cached full blocks of token_ids as (block id, chain hash, entry uid); read-only."""
        if not self.enable_prefix_cache:
            return []
        size = self.block_size
        hits: list[tuple[int, int, int]] = []
        parent_hash, parent_uid = None, _ROOT_UID
        for i in range((len(token_ids) - 1) // size):  # leave at least one token to compute
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            h = block_hash(namespace, parent_hash, tokens)
            block_id = self._by_hash.get(h)
            entry = self._entries.get(block_id) if block_id is not None else None
            if entry is None or not entry.matches(namespace, parent_uid, tokens):
                break  # a miss, or a hash collision: verification failed
            assert block_id is not None  # an entry was found under it
            hits.append((block_id, h, entry.uid))
            parent_hash, parent_uid = h, entry.uid
        return hits

    def _register(self, block_id: int, h: int, namespace: Hashable, parent_uid: int,
                  tokens: tuple[int, ...]) -> int:
        """File a computed full block under its hash; return the uid that identifies its content."""
        if block_id in self._entries:  # a prefix hit or a fork sibling registered it already
            return self._entries[block_id].uid
        holder = self._by_hash.get(h)
        if holder is not None:
            entry = self._entries[holder]
            if entry.matches(namespace, parent_uid, tokens):
                return entry.uid  # same content already cached in another block: chain through it
            return self._new_uid()  # a collision: this block stays uncached, its children unreachable
        uid = self._new_uid()
        self._entries[block_id] = _CacheEntry(h, namespace, parent_uid, tokens, uid)
        self._by_hash[h] = block_id
        return uid

    def _new_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid

    def _ref(self, block_id: int) -> None:
        if self._refcount[block_id] == 0:
            del self._evictable[block_id]  # a hit revives an unreferenced cached block
        self._refcount[block_id] += 1

    def _take_block(self) -> int:
        """A block for new KV: a free one, else evict the least recently freed cached one."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            entry = self._entries.pop(block_id)
            del self._by_hash[entry.block_hash]
            self.stats.evictions += 1
        self._refcount[block_id] = 1
        return block_id

    def _tail_is_shared(self, table: BlockTable) -> bool:
        return table.num_tokens % self.block_size != 0 and self._refcount[table.block_ids[-1]] > 1

    def _append_cost(self, table: BlockTable, num_new_tokens: int) -> int:
        if num_new_tokens <= 0:
            return 0
        new_blocks = self.blocks_needed(table.num_tokens + num_new_tokens) - len(table.block_ids)
        return new_blocks + (1 if self._tail_is_shared(table) else 0)
