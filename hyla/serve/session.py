"""One sequence kept in a serving :class:`~hyla.serve.runner.Runner`: what ``hyla generate``
and ``hyla chat`` decode on, so they take the engine's lean step (KV blocks written and read
in place, logits of the last row only) instead of copying a
:class:`~hyla.model.state.SequenceState` into one-block buffers and back every token.

A :class:`RunnerState` stands where a SequenceState stood for
:func:`hyla.model.stream.stream_tokens`: it has ``num_tokens`` and takes prompt chunks
(``prefill``) and single tokens (``decode``), returning the last row's logits. Its KV blocks
are reserved for ``capacity`` tokens (resident only as they fill) and grow by doubling when a
conversation outgrows them.

Example:
    >>> import torch
    >>> from hyla.model import HylaLM, preset
    >>> model = HylaLM(preset("debug")).eval()
    >>> state = RunnerState(model)
    >>> state.prefill([1, 2, 3]).shape, state.decode(4).shape, state.num_tokens
    (torch.Size([256]), torch.Size([256]), 4)
"""

from __future__ import annotations

import torch

from hyla.model import HylaLM
from hyla.model.sampler import accept_drafts
from hyla.serve.hidden_log import HiddenLog
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams

_GREEDY = SamplingParams(temperature=0)


class RunnerState:
    """A single sequence's state in slot 0 of a one-slot :class:`Runner`, its KV blocks
    ``0, 1, 2, ...`` (consecutive: decode reads them as one view)."""

    def __init__(self, model: HylaLM, *, capacity: int = 2048, block_size: int = 16,
                 kv_dtype: torch.dtype | None = None, chunk: int = 2048):
        """``capacity``: tokens the first reservation holds; ``chunk``: prompt tokens
        computed at once (bounds prefill memory)."""
        if capacity < 1 or block_size < 1 or chunk < 1:
            raise ValueError(f"capacity, block_size and chunk must be >= 1, got {capacity}, "
                             f"{block_size}, {chunk}")
        self.model, self.block_size, self.chunk = model, block_size, chunk
        self.kv_dtype = kv_dtype
        self.has_growing = any(spec.per_token for spec in model.state_specs)
        self.num_tokens = 0
        self.runner: Runner | None = None
        self.num_blocks = 0
        self.hidden_log: HiddenLog | None = None
        self._reserve(capacity)

    def keep_hidden(self) -> HiddenLog:
        """Keep the final hidden state of every row computed from now on (what
        ``--speculative mtp`` drafts from, :class:`~hyla.serve.mtp_drafter.MTPDrafter`)."""
        if self.hidden_log is None:
            self.hidden_log = self.runner.hidden_log = HiddenLog()
        return self.hidden_log

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _reserve(self, tokens: int) -> None:
        """Blocks for ``tokens`` tokens: a bigger runner (twice the blocks at least) with
        this state copied in, when the present one is too small."""
        need = self._blocks_for(tokens)
        if self.runner is not None and (need <= self.num_blocks or not self.has_growing):
            return
        blocks = max(need, 2 * self.num_blocks) if self.has_growing else 0
        runner = Runner(self.model, max_num_seqs=1, num_kv_blocks=blocks,
                        block_size=self.block_size, kv_dtype=self.kv_dtype)
        if self.runner is not None and self.num_tokens:
            old = self.runner.extract(0, self.num_tokens, self._table(self.num_tokens))
            runner.load(0, old, list(range(blocks)))
        runner.hidden_log = self.hidden_log     # (set after load: load clears the slot's)
        self.runner, self.num_blocks = runner, blocks

    def _table(self, tokens: int) -> list[int]:
        return list(range(self._blocks_for(tokens))) if self.has_growing else []

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` after what the state holds; the logits [vocab] after the last."""
        if not ids:
            raise ValueError("ids must hold at least one token, got []")
        self._reserve(self.num_tokens + len(ids))
        logits = None
        for at in range(0, len(ids), self.chunk):
            part = list(ids[at:at + self.chunk])
            start = self.num_tokens
            logits = self.runner.prefill([(0, part, start, self._table(start + len(part)))])
            self.num_tokens += len(part)
        return logits[0]

    @torch.no_grad()
    def decode(self, token: int) -> torch.Tensor:
        """Feed one token; the logits [vocab] after it."""
        self._reserve(self.num_tokens + 1)
        pos = self.num_tokens
        logits = self.runner.decode([0], [int(token)], [pos], [self._table(pos + 1)], width=1)
        self.num_tokens += 1
        return logits[0]

    @torch.no_grad()
    def speculate(self, token: int, drafts: list[int]) -> list[int]:
        """Feed ``token`` (sampled last, not yet fed) and verify greedy ``drafts`` after it
        in one forward: the drafts the model agrees with and then its own next token, which
        is not fed. A fixed-size state that took rejected drafts is restored and the kept
        tokens recomputed, so the state is the one plain greedy steps would hold."""
        n, tokens = self.num_tokens, [int(token)] + [int(t) for t in drafts]
        self._reserve(n + len(tokens))
        saved = self.runner.save_scratch(0)
        logits = self.runner.verify(0, tokens, n, self._table(n + len(tokens)))
        j, after = accept_drafts(logits, tokens[1:], _GREEDY)
        if j < len(drafts) and saved:
            self.runner.restore_scratch(0, saved)
            self.runner.verify(0, tokens[:j + 1], n, self._table(n + j + 1))
        self.num_tokens = n + j + 1
        return tokens[1:j + 1] + [after]
