"""Draft tokens for speculative decoding by n-gram lookup in the sequence itself (prompt
lookup decoding): where the last few tokens occurred before, guess that what followed them
then follows now. Free to compute, and right often on repetitive work (editing code,
quoting the prompt). Pure Python.

The engine (:meth:`hyla.serve.engine.Engine.step`) verifies the drafts in one forward and
keeps the longest prefix the model agrees with, plus the model's own next token; a recurrent
state that consumed rejected drafts is restored and recomputed, so the output is the model's
greedy output.

Example:
    >>> ngram_drafts([1, 2, 3, 4, 9, 1, 2, 3], 3)
    [4, 9, 1]
    >>> ngram_drafts([5, 6, 7], 2)
    []
"""

from __future__ import annotations

SPECULATIVE_METHODS = ("ngram",)


def ngram_drafts(tokens: list[int], k: int, *, max_n: int = 3, min_n: int = 1,
                 window: int = 4096) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_n`` down to ``min_n``; the longest match wins), looked for
    in its last ``window`` tokens. Empty when nothing matches."""
    if k <= 0:
        return []
    seq = tokens[-window:]
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        # the latest occurrence that is not the tail itself
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []
