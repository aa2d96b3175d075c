"""The target model's final hidden states by slot and position, as a runner computes them:
what multi-token-prediction drafts read (:class:`hyla.serve.mtp_drafter.MTPDrafter`).

Each slot keeps one run of consecutive positions. Rows written at a position inside the run
replace it from there on (a verify's rejected drafts are overwritten by the tokens that
follow); rows that leave a gap, or a slot reset, start a new run. A run keeps its last
``keep`` rows at least and ``2 * keep`` at most (trimmed when it passes that: a cost
spread over ``keep`` rows, not paid on each). Rows are copies: a decode step's rows are
slices of its whole output, logits included, which a view would keep alive.

Example:
    >>> import torch
    >>> log = HiddenLog(keep=2)
    >>> log.put(0, 0, torch.zeros(3, 2)); log.put(0, 3, torch.ones(2, 2))
    >>> log.span(0)                 # past 2 * keep rows: the last 2 are kept
    (3, 5)
    >>> log.put(0, 4, torch.full((1, 2), 7.0)); log.rows(0, 3, 5)[:, 0].tolist()
    [1.0, 7.0]
"""

from __future__ import annotations

import torch


class HiddenLog:
    def __init__(self, keep: int = 4096):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._runs: dict[int, tuple[int, list[torch.Tensor], int]] = {}  # start, parts, rows

    def put(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Rows [T, d] for positions ``start .. start + T - 1`` of ``slot``."""
        run = self._runs.get(slot)
        if run is None or not run[0] <= start <= run[0] + run[2]:
            run = (start, [], 0)
        elif start < run[0] + run[2]:
            run = (run[0], [self._cat(run)[:start - run[0]]], start - run[0])
        first, parts, n = run
        parts.append(rows.detach().clone())
        n += rows.shape[0]
        if n > 2 * self.keep:
            parts = [torch.cat(parts)[n - self.keep:].clone()]
            first, n = first + n - self.keep, self.keep
        self._runs[slot] = (first, parts, n)

    def span(self, slot: int) -> tuple[int, int]:
        """(first, end): the positions ``first .. end - 1`` are held; (0, 0) when none."""
        run = self._runs.get(slot)
        return (0, 0) if run is None else (run[0], run[0] + run[2])

    def rows(self, slot: int, a: int, b: int) -> torch.Tensor:
        """The rows of positions ``a .. b - 1`` (all held: see :meth:`span`)."""
        first, end = self.span(slot)
        if not first <= a <= b <= end:
            raise ValueError(f"slot {slot} holds positions [{first}, {end}), asked for "
                             f"[{a}, {b})")
        run = self._runs[slot]
        return self._cat(run)[a - first:b - first]

    def clear(self, slot: int) -> None:
        self._runs.pop(slot, None)

    def nbytes(self) -> int:
        """The bytes of the rows it holds, every slot's."""
        return sum(t.numel() * t.element_size() for _, parts, _ in self._runs.values()
                   for t in parts)

    def _cat(self, run) -> torch.Tensor:
        first, parts, n = run
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0] if parts else torch.empty(0)
