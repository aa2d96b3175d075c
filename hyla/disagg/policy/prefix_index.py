"""The router's estimate of what each PD worker's prefix cache holds (no torch).

The policy routes on the *incremental* prefill: the prompt minus its cached prefix. Asking
every worker per request would cost a round trip, so the router keeps its own index, as
cache-aware routers do: every prompt it prefills on a worker is recorded there as a chain
of hashes of ``chunk_tokens``-token chunks (the engine's GLA snapshot interval: a hybrid
model's cache only resumes at those boundaries), least recently used first out. It is an
estimate (a worker may have evicted a prefix since); a wrong guess costs time, not
correctness, since the worker's own cache decides what is recomputed.
"""

from __future__ import annotations

from collections import OrderedDict


def chunk_chain(ids: list[int], chunk_tokens: int) -> list[int]:
    """Hash of every whole ``chunk_tokens`` chunk of ``ids``, each chained to the ones
    before it (equal hashes: equal prefixes)."""
    chain, h = [], 0
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        h = hash((h, tuple(ids[start:start + chunk_tokens])))
        chain.append(h)
    return chain


class PrefixIndex:
    """Per worker, the chunk hashes of prompts prefilled there (LRU, ``capacity`` each).

    Example:
        >>> idx = PrefixIndex(chunk_tokens=4, capacity=100)
        >>> idx.insert("w1", chunk_chain(list(range(10)), 4))
        >>> idx.best(chunk_chain(list(range(9)) + [99, 98], 4))
        ('w1', 8)
        >>> idx.best(chunk_chain([5] * 12, 4))
        (None, 0)
    """

    def __init__(self, chunk_tokens: int = 256, capacity: int = 65_536):
        if chunk_tokens < 1 or capacity < 1:
            raise ValueError(f"chunk_tokens and capacity must be >= 1, got {chunk_tokens}, "
                             f"{capacity}")
        self.chunk_tokens, self.capacity = chunk_tokens, capacity
        self.workers: dict[str, OrderedDict[int, None]] = {}

    def insert(self, worker: str, chain: list[int]) -> None:
        seen = self.workers.setdefault(worker, OrderedDict())
        for h in chain:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def match(self, worker: str, chain: list[int]) -> int:
        """Tokens of the longest prefix of ``chain`` recorded for ``worker``."""
        seen = self.workers.get(worker)
        n = 0
        if seen:
            for h in chain:
                if h not in seen:
                    break
                n += 1
        return n * self.chunk_tokens

    def best(self, chain: list[int], workers: list[str] | None = None) -> tuple[str | None, int]:
        """(worker, cached tokens) of the longest match among ``workers`` (default: all)."""
        best, n = None, 0
        for w in workers if workers is not None else list(self.workers):
            m = self.match(w, chain)
            if m > n:
                best, n = w, m
        return best, n

    def forget(self, worker: str) -> None:
        """Drop a worker's entries (it failed or restarted: its cache is gone)."""
        self.workers.pop(worker, None)
