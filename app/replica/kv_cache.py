"""Paged KV cache: fixed-size blocks, a ref-counted allocator, and prefix caching by hash chains.

The allocator is pure Python (the scheduler is tested without tensors); `KVCache` holds the tensors.
A block's prefix hash covers every token before it *and* the adapter identity, so the same tokens under
different adapters (or adapter versions) never share KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


def block_hash(parent: bytes | None, tokens: tuple[int, ...], adapter: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(adapter.encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockAllocator:
    """Hands out KV blocks; cached (hashed) blocks with no users stay reusable until evicted LRU-first."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-hashed or dropped blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, ref 0, LRU order
        self._by_hash: dict[bytes, int] = {}
        self.hits = 0
        self.queries = 0
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self) -> int:
        if self._free:
            bid = self._free.pop()
        elif self._evictable:
            bid, _ = self._evictable.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None and self._by_hash.get(blk.hash) == bid:
                del self._by_hash[blk.hash]
            blk.hash = None
        else:
            raise MemoryError("no free KV blocks")
        self.blocks[bid].ref_count = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return bid

    def free(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            blk = self.blocks[bid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0, f"block {bid} freed twice"
            if blk.ref_count == 0:
                if blk.hash is not None and self.enable_prefix_caching:
                    self._evictable[bid] = None
                else:
                    blk.hash = None
                    self._free.append(bid)

    def cached(self, h: bytes) -> bool:
        """Whether a block with key `h` is in the prefix cache (no reference taken)."""
        return h in self._by_hash

    def lookup(self, h: bytes) -> int | None:
        """Take a reference on the cached block with key `h`, if any."""
        bid = self._by_hash.get(h)
        if bid is None:
            return None
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            self._evictable.pop(bid, None)
        blk.ref_count += 1
        self.peak_used = max(self.peak_used, self.num_used)
        return bid

    def count_prefix(self, queries: int, hits: int) -> None:
        """Prefix-cache statistics: `queries` leading blocks of a prompt looked for, `hits` of them reused."""
        self.queries += queries
        self.hits += hits

    def register(self, bid: int, h: bytes) -> None:
        """Record that block `bid` now holds the full block with prefix hash `h`."""
        if not self.enable_prefix_caching:
            return
        if h in self._by_hash:  # another sequence computed the same block first; keep theirs
            return
        self.blocks[bid].hash = h
        self._by_hash[h] = bid


class KVCache:
    """K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim], one per layer of a KV group
    (app/replica/kv_layout.py: `num_layers` is the layout's width; every layer when there is one group)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
