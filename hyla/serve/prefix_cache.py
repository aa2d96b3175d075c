"""Hybrid prefix cache: attention KV blocks by chained hashes, fixed-size states by snapshots.

A prompt is cut into full blocks of ``block_size`` tokens; block i's hash chains the hash of
block i-1 with its tokens, so equal hashes mean equal prefixes. Attention layers can reuse
any prefix of cached KV blocks (partial match). GLA layers keep one matrix for the whole
past, so they can only resume from a state *snapshotted at exactly that boundary*: the
runner copies the state of a sequence into a snapshot slot when a prefill chunk ends at a
snapshot boundary (every ``snapshot_interval`` tokens, and the prompt's last full block).
A hit is the longest boundary for which every layer kind has what it needs. Generated
tokens count too: as a decoding sequence fills a block, the block joins the cache and the
sequence's one rolling snapshot moves to its end (:meth:`PrefixCache.move_snapshot`), so a
chat's next turn, which repeats the answer, resumes after it. "GLA" here stands for every
layer whose state has a fixed size (gated delta rule, Mamba-2, convolution windows...): the
runner snapshots all of them alike. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hyla.serve.block_manager import BlockManager


@dataclass
class PrefixMatch:
    """``num_tokens`` prompt tokens are cached: share ``kv_blocks`` and restore ``snapshot``."""

    num_tokens: int = 0
    kv_blocks: list[int] = field(default_factory=list)
    snapshot: int | None = None


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (deterministic across processes).

    Example:
        >>> a = block_hashes([1, 2, 3, 4, 5], 2); b = block_hashes([1, 2, 3, 9], 2)
        >>> len(a), a[0] == b[0], a[1] == b[1]
        (2, True, False)
    """
    return extend_hashes([], token_ids, block_size)


def extend_hashes(hashes: list[int], token_ids: list[int], block_size: int) -> list[int]:
    """``hashes`` (the chain of ``token_ids``' first blocks) extended, in place, to every
    full block of ``token_ids``: a decoding sequence's chain grows as its blocks fill.

    Example:
        >>> h = block_hashes([1, 2, 3], 2)
        >>> extend_hashes(h, [1, 2, 3, 4, 5, 6], 2) == block_hashes([1, 2, 3, 4, 5, 6], 2)
        True
    """
    h = hashes[-1] if hashes else 0
    for i in range(len(hashes), len(token_ids) // block_size):
        h = hash((h, *token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(h)
    return hashes


class PrefixCache:
    """Finds cached prefixes and records new ones.

    Args:
        block_size: tokens per block (the KV page size and the snapshot granularity).
        block_manager: the KV pages (None for a model without attention layers).
        num_snapshots: GLA state snapshot slots (0 for a model without GLA layers).
        snapshot_interval: a multiple of ``block_size``; prefill is cut at its multiples.

    Example:
        >>> pc = PrefixCache(4, None, num_snapshots=2, snapshot_interval=8)
        >>> hs = block_hashes(list(range(10)), 4)
        >>> pc.save_snapshot(hs[1])          # a snapshot after 8 tokens: slot 0
        0
        >>> m = pc.match(list(range(12))); m.num_tokens
        8
        >>> pc.record(12, m.num_tokens); pc.hit_rate
        0.6666666666666666
    """

    def __init__(self, block_size: int, block_manager: BlockManager | None,
                 num_snapshots: int = 0, snapshot_interval: int = 512):
        if snapshot_interval % block_size:
            raise ValueError(f"snapshot_interval ({snapshot_interval}) must be a multiple of "
                             f"block_size ({block_size})")
        self.block_size = block_size
        self.block_manager = block_manager
        self.snapshot_interval = snapshot_interval
        self.num_snapshots = num_snapshots
        self.has_gla = num_snapshots > 0
        self.kv: dict[int, int] = {}                       # hash -> KV block
        self.snapshots: OrderedDict[int, int] = OrderedDict()   # hash -> slot, LRU first
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self.query_tokens = 0
        self.hit_tokens = 0
        # the runner's check that a snapshot is as saved (its checksum); one that fails is
        # dropped, and the prompt matches a shorter prefix (recomputed, never served)
        self.snapshot_intact: Callable[[int], bool] | None = None
        self.corrupt_snapshots = 0
        if block_manager is not None:
            block_manager.on_evict = self._forget_block

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def match(self, token_ids: list[int]) -> PrefixMatch:
        """The longest usable cached prefix of a prompt (at most all but its last token,
        whose logits the engine needs). Counted in ``hit_rate`` once :meth:`record`ed."""
        hashes = block_hashes(token_ids[:-1], self.block_size)
        best, found = PrefixMatch(), []
        for i, h in enumerate(hashes):
            if self.block_manager is not None:
                block = self.kv.get(h)
                if block is None:
                    break
                best_blocks = [self.kv[x] for x in hashes[:i + 1]]
            else:
                best_blocks = []
            if self.has_gla:
                snap = self.snapshots.get(h)
                if snap is None:
                    continue        # attention could go further; GLA needs an exact boundary
                found.append((h, PrefixMatch((i + 1) * self.block_size, best_blocks, snap)))
            else:
                best = PrefixMatch((i + 1) * self.block_size, best_blocks)
        while found:                # the longest snapshot still as it was saved
            h, candidate = found.pop()
            if self.snapshot_intact is None or self.snapshot_intact(candidate.snapshot):
                best = candidate
                break
            del self.snapshots[h]
            self._free_snapshots.append(candidate.snapshot)
            self.corrupt_snapshots += 1
        if best.snapshot is not None:
            self.snapshots.move_to_end(hashes[best.num_tokens // self.block_size - 1])
        return best

    def kv_blocks(self, token_ids: list[int]) -> list[int] | None:
        """The cached KV blocks of every full block of ``token_ids`` (a shipped state's
        prefix: its fixed-size states come with it, so no snapshot is needed), or None
        unless all are cached."""
        if self.block_manager is None:
            return None
        blocks = [self.kv.get(h) for h in block_hashes(token_ids, self.block_size)]
        return None if None in blocks else blocks

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt in the hit rate (a match that was not admitted, for
        lack of room, is retried later and must not count twice)."""
        self.query_tokens += num_prompt_tokens
        self.hit_tokens += num_hit_tokens

    def is_snapshot_boundary(self, num_tokens: int, prompt_len: int) -> bool:
        """Whether a prefill that has computed ``num_tokens`` should snapshot GLA states."""
        if not self.has_gla or num_tokens == 0 or num_tokens % self.block_size:
            return False
        return (num_tokens % self.snapshot_interval == 0
                or num_tokens == (prompt_len - 1) // self.block_size * self.block_size)

    def next_boundary(self, num_computed: int, prompt_len: int) -> int | None:
        """The first snapshot boundary after ``num_computed`` within the prompt, or None."""
        if not self.has_gla:
            return None
        last = (prompt_len - 1) // self.block_size * self.block_size
        nxt = (num_computed // self.snapshot_interval + 1) * self.snapshot_interval
        b = min(nxt, last)
        return b if b > num_computed else None

    def save_snapshot(self, h: int) -> int | None:
        """A snapshot slot for boundary hash ``h`` (the runner fills it), evicting the least
        recently used; None when that boundary is already saved or there are no slots."""
        if not self.has_gla or h in self.snapshots:
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        else:
            _, slot = self.snapshots.popitem(last=False)
        self.snapshots[h] = slot
        return slot

    def move_snapshot(self, old: int | None, new: int) -> int | None:
        """A decoding sequence's one rolling snapshot, moved from boundary ``old`` (None: it
        has none yet) to ``new``: the same slot, re-keyed (the runner overwrites it), so a
        conversation's next turn finds its state after the answer without each block of
        the answer taking a slot. None when ``new`` is saved already or there is no slot."""
        if not self.has_gla or new in self.snapshots:
            return None
        slot = self.snapshots.pop(old, None) if old is not None else None
        if slot is None:
            return self.save_snapshot(new)
        self.snapshots[new] = slot
        return slot

    def insert_blocks(self, hashes: list[int], blocks: list[int]) -> None:
        """Record computed full KV blocks under their hashes (first writer wins)."""
        if self.block_manager is None:
            return
        for h, block in zip(hashes, blocks, strict=False):
            if h not in self.kv and self.block_manager.block_hash[block] is None:
                self.kv[h] = block
                self.block_manager.set_hash(block, h)

    def _forget_block(self, block: int, h: int) -> None:
        if self.kv.get(h) == block:
            del self.kv[h]
