"""A sequence's block tables, one per KV group (app/replica/kv_layout.py), over the shared `BlockAllocator`:
growing them for the tokens a step feeds, freeing a sliding group's blocks once they fall wholly before the
window, reusing cached prefixes, and registering full blocks for reuse. Pure Python, like the scheduler.

A freed sliding block leaves -1 in its table: positions stay block indexes. Prefix caching covers every group:
each group's block j is cached under the hash chain of the tokens up to its end (and the adapter), keyed by
group too; a freed sliding block keeps its hash until the pool evicts it. A cached prefix is reused up to the
longest length at which every group has every block it still needs (the global groups all blocks before it,
the sliding ones those in the window before it).
"""

from __future__ import annotations

from app.replica.kv_cache import BlockAllocator, block_hash
from app.replica.kv_layout import KVLayout
from app.replica.sequence import Sequence

GLOBAL = KVLayout((None,), 1, (0,), (0,))  # the scheduler's default: one group, every block kept


def group_key(h: bytes, group: int) -> bytes:
    """The prefix-cache key of group `group`'s block with hash h (group 0: the hash itself, as before groups)."""
    return h if group == 0 else h + group.to_bytes(2, "little")


class BlockTables:
    def __init__(self, allocator: BlockAllocator, layout: KVLayout, block_size: int):
        self.alloc, self.layout, self.bs = allocator, layout, block_size

    def reset(self, seq: Sequence) -> None:
        """Give back every block the sequence holds; its tables start empty."""
        self.alloc.free(seq.live_blocks())
        seq.tables = [[] for _ in self.layout.windows]
        seq.block_hashes = []
        seq.num_computed = 0

    def needed(self, seq: Sequence, num_new: int) -> int:
        """Blocks to allocate, all groups together, so that `num_new` more tokens have slots."""
        total = -(-(seq.num_computed + num_new) // self.bs)
        return sum(max(0, total - len(t)) for t in seq.tables)

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Allocate the blocks `num_new` more tokens need (all or none); False when the pool has too few."""
        if self.needed(seq, num_new) > self.alloc.num_free:
            return False
        total = -(-(seq.num_computed + num_new) // self.bs)
        for t in seq.tables:
            t.extend(self.alloc.allocate() for _ in range(total - len(t)))
        return True

    def drop_dead(self, seq: Sequence) -> None:
        """Free the sliding groups' blocks that no query from position num_computed on reads."""
        for g, t in enumerate(seq.tables):
            j = min(self.layout.first_needed(g, seq.num_computed, self.bs), len(t)) - 1
            dead = []
            while j >= 0 and t[j] >= 0:
                dead.append(t[j])
                t[j] = -1
                j -= 1
            self.alloc.free(dead)

    def reuse_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks for the sequence's leading full blocks (at least one token stays uncomputed)."""
        bs, ids, windows = self.bs, seq.all_ids, self.layout.windows
        cand = (len(ids) - 1) // bs
        hashes: list[bytes] = []
        parent = None
        for j in range(cand):  # the global groups' prefix ends at group 0's first miss
            h = block_hash(parent, tuple(ids[j * bs : (j + 1) * bs]), seq.kv_key((j + 1) * bs))
            if windows[0] is None and not self.alloc.cached(h):
                break
            hashes.append(h)
            parent = h
        m = len(hashes)
        while m > 0 and not self._usable(hashes, m):
            m -= 1
        self.alloc.count_prefix(queries=m + (m < cand), hits=m)
        seq.tables = []
        for g in range(len(windows)):  # a sliding group takes only the blocks in the window before m
            first = self.layout.first_needed(g, m * bs, bs)
            seq.tables.append(
                [-1] * first + [self.alloc.lookup(group_key(hashes[j], g)) for j in range(first, m)]
            )
        seq.block_hashes = hashes[:m]
        seq.num_computed = m * bs

    def _usable(self, hashes: list[bytes], m: int) -> bool:
        """Every group has every block that a query at position m * block_size reads before it, cached."""
        for g in range(len(self.layout.windows)):
            fn = self.layout.first_needed(g, m * self.bs, self.bs)
            if not all(self.alloc.cached(group_key(hashes[j], g)) for j in range(fn, m)):
                return False
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step advanced num_computed: register its newly filled blocks (every group's) for reuse, then
        free the sliding blocks the window has left behind."""
        bs = self.bs
        while len(seq.block_hashes) < seq.num_computed // bs:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tuple(seq.token_range(j * bs, (j + 1) * bs)), seq.kv_key((j + 1) * bs))
            for g, t in enumerate(seq.tables):
                if t[j] >= 0:
                    self.alloc.register(t[j], group_key(h, g))
            seq.block_hashes.append(h)
        if len(seq.tables) > 1 or self.layout.windows[0] is not None:
            self.drop_dead(seq)
