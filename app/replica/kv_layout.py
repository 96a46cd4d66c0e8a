"""Which layers share which paged-KV block tables: one group for a model whose layers all attend the same way,
several for a model that mixes sliding-window and global layers (Gemma 3: five sliding layers per global one).

The idea is vLLM's hybrid KV cache manager's: layers are split into groups of equal size `width`, each group
of one attention kind (global, or one window). Every group has its own block table per sequence, but all draw
from one pool of blocks, and a block holds `width` layers' K/V (the cache keeps `width` tensors: slot j of a
block belongs to layer j of whichever group owns the block). A sliding group's blocks wholly before a
sequence's window go back to the pool as it grows, so its live blocks stay near window / block_size while the
global group's grow with the context. `width` is the smallest kind's layer count; a kind whose count it does
not divide pads its last group (that group's unused slot costs memory, never compute).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: its sliding window, None for global attention
    width: int  # layers per group: the KV tensors' count
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its tensor, in [0, width)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> KVLayout:
        """Groups for these per-layer windows; global layers (if any) form the first groups, so group 0's table
        holds every block of a sequence whenever the model has a global layer."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for li, w in sorted(enumerate(layer_windows), key=lambda x: x[1] is not None):
            kinds.setdefault(w, []).append(li)
        width = min(len(ls) for ls in kinds.values())
        windows: list[int | None] = []
        group, slot = [0] * len(layer_windows), [0] * len(layer_windows)
        for w, layers in kinds.items():
            for i, li in enumerate(layers):
                if i % width == 0:
                    windows.append(w)
                group[li], slot[li] = len(windows) - 1, i % width
        return cls(tuple(windows), width, tuple(group), tuple(slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def pool_blocks(self, num_kv_blocks: int, num_layers: int) -> int:
        """The pool's blocks (each `width` layers) in the memory of `num_kv_blocks` blocks of every layer."""
        return num_kv_blocks * num_layers // self.width

    def first_needed(self, group: int, position: int, block_size: int) -> int:
        """The first block of `group` that a query at `position` (or later) still reads: 0 for a global group,
        the block holding position - window + 1 for a sliding one (transformers' mask: j > i - window)."""
        w = self.windows[group]
        return 0 if w is None else max(0, position - w + 1) // block_size

    def blocks_needed(self, tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of `tokens` tokens holds at once when prefilled in chunks of at most
        `chunk` tokens: every block for a global group, a sliding group only its window and one chunk."""
        full = -(-tokens // block_size)
        out = 0
        for w in self.windows:
            out += full if w is None else min(full, -(-(w - 1 + chunk) // block_size) + 1)
        return out
