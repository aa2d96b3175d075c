"""Paged KV blocks for the attention layers: reference-counted, with cached-block reuse.

Each block holds ``block_size`` tokens of keys and values for every attention layer (the
runner owns the tensors ``[num_blocks, block_size, H_kv, D]``). A block is owned by the
sequences whose block tables list it; ``ref_count`` says how many. A freed block that the
prefix cache knows (it has a hash) stays readable in the free queue until it is reused,
oldest first, so a repeated prompt can pick it up again. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockManager:
    """Allocate, share and free KV blocks.

    ``on_evict(block, hash)`` is called when a cached block is handed out again, so the
    prefix cache can forget it.

    Example:
        >>> bm = BlockManager(num_blocks=4, block_size=16)
        >>> blocks = bm.allocate(3)
        >>> bm.num_free, bm.blocks_for(33)
        (1, 3)
        >>> bm.free(blocks); bm.num_free
        4
    """

    def __init__(self, num_blocks: int, block_size: int,
                 on_evict: Callable[[int, int], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in reuse order (front first); cached ones are still in it.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that allocate() can hand out (free ones and evictable cached ones)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks, each with ref_count 1; raises if fewer are free (check first).

        ``after``: the last block of the table these extend. The block after it is taken
        first when it is free and not cached (and so on), so a sequence's blocks tend to be
        consecutive and decode reads them in place as one view
        (:func:`hyla.ops.paged_attention.attend_spans`); otherwise blocks come in reuse order.

        Example:
            >>> bm = BlockManager(num_blocks=8, block_size=16)
            >>> a, b = bm.allocate(2), bm.allocate(1)
            >>> bm.free(a); bm.allocate(1, after=b[0]), bm.allocate(1, after=None)
            ([3], [4])
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} KV blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            nxt = None if after is None else after + 1
            # not a cached block: taking it would evict a prefix (a chat's previous turn)
            # while blocks nobody cached wait in the queue
            if nxt is not None and nxt in self._free and self.block_hash[nxt] is None:
                del self._free[nxt]
                block = nxt
            else:
                block, _ = self._free.popitem(last=False)
            after = block
            h = self.block_hash[block]
            if h is not None:
                self.block_hash[block] = None
                if self.on_evict is not None:
                    self.on_evict(block, h)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more owner for ``block`` (a prefix-cache hit); revives a freed cached block."""
        if self.ref_count[block] == 0:
            if self.block_hash[block] is None:
                raise ValueError(f"block {block} is free and uncached: nothing to share")
            del self._free[block]
        self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last block of a table is reused first."""
        for block in reversed(blocks):
            if self.ref_count[block] <= 0:
                raise ValueError(f"block {block} is not allocated (double free?)")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None

    def set_hash(self, block: int, h: int) -> None:
        self.block_hash[block] = h
