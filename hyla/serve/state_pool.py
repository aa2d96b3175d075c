"""Fixed set of GLA-state slots: one per running sequence, allocated up front.

The runner preallocates ``[num_slots + 1, H, K, V]`` fp32 per GLA layer (the extra slot is
the padding row that decode widths write to); this class only decides who owns which
slot. Pure Python: the simulator uses it as is.
"""

from __future__ import annotations


class StatePool:
    """Hands out slot indices ``0 .. num_slots - 1``; lowest free first.

    Example:
        >>> pool = StatePool(2)
        >>> a, b = pool.allocate(), pool.allocate()
        >>> pool.num_free, pool.allocate()
        (0, None)
        >>> pool.free(a); pool.num_free
        1
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots (max_num_seqs) must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # a stack: pop() gives the lowest
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int | None:
        """A free slot, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated (double free?)")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def used_slots(self) -> set[int]:
        return set(self._used)
