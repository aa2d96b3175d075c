"""The batch description every forward receives: training, prefill or decode.

One :class:`Context` tells the block loop and every mixer what the rows of ``input_ids``
are. Training: packed documents (``cu_seqlens``) and their rotary positions, no state.
Prefill: chunks of several prompts packed into one row, each continuing the state its
sequence already holds (``starts``), found through its slot and block table. Decode: one
token for each of B sequences. In the last two the caller owns the state buffers and
hands them in ``buffers`` (per layer, by the names of the mixer's StateSpec): fixed
entries as ``[slots, *shape]``, growing entries paged as ``[blocks, block_size, *shape]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyla.ops.attention import check_cu_seqlens


@dataclass(eq=False)
class Context:
    """What a batch is. Build one with :meth:`train`, :meth:`prefill` or :meth:`decode`.

    Example:
        >>> ctx = Context.train(torch.zeros(1, 5, dtype=torch.long), torch.tensor([0, 2, 5]))
        >>> ctx.mode, ctx.positions.tolist()
        ('train', [0, 1, 0, 1, 2])
    """

    mode: str                                  # "train", "prefill" or "decode"
    positions: torch.Tensor                    # train [T]; prefill [tokens]; decode [B]
    cu_seqlens: torch.Tensor | None = None     # train (packed docs) and prefill (chunks)
    buffers: list[dict[str, torch.Tensor]] | None = None
    slots: torch.Tensor | None = None          # [N] each sequence's row of fixed buffers
    slot_span: slice | None = None             # slots are consecutive: update views in place
    starts: tuple[int, ...] = ()               # prefill: tokens each sequence already holds
    lengths: tuple[int, ...] = ()              # prefill: tokens of each chunk
    block_tables: torch.Tensor | None = None   # [N, blocks] long, padded
    block_size: int = 1
    token_blocks: torch.Tensor | None = None   # the block and offset each new token's row
    token_offsets: torch.Tensor | None = None  #   goes to in a growing buffer
    logits_at: torch.Tensor | None = None      # rows to compute logits for (None: all)
    # decode, eager: a sequence's new row's (block, offset) and the row ranges of the
    # flattened paged buffer holding its rows (hyla.ops.paged_attention.kv_spans), so attention
    # reads them as views instead of gathering them
    kv_spans: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] | None = None
    # what every layer of one forward would compute alike (rotary tables), by the layer's key
    memo: dict = field(default_factory=dict)
    # decode: rows may be consecutive tokens of one sequence (a speculative verify's), so a
    # layer with fixed-size state takes them one at a time (Block, with row(b)), as plain
    # steps do, rather than as a chunk, whose arithmetic rounds otherwise
    chain: bool = False

    # -- builders ------------------------------------------------------------------------
    @classmethod
    def train(cls, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
              ) -> Context:
        """Training on ``input_ids`` [B, T]; with ``cu_seqlens`` (B == 1) the row is packed
        documents: rotary positions restart and linear states reset at every boundary."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        dev = input_ids.device
        positions = torch.arange(T, device=dev)
        if cu_seqlens is not None:
            offsets = check_cu_seqlens(cu_seqlens, B, T)
            lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:], strict=True)]
            positions = positions - torch.tensor(offsets[:-1], device=dev).repeat_interleave(
                torch.tensor(lengths, device=dev))
            cu_seqlens = cu_seqlens.to(dev)
        return cls("train", positions, cu_seqlens)

    @classmethod
    def prefill(cls, starts: list[int], lengths: list[int], slots: list[int],
                block_tables: list[list[int]], buffers: list[dict[str, torch.Tensor]], *,
                block_size: int, pad_block: int = 0, device=None, last_logits: bool = True
                ) -> Context:
        """Chunks of N sequences packed into one row: chunk j is ``lengths[j]`` tokens at
        positions ``starts[j] ..``, its state in row ``slots[j]`` of the fixed buffers and
        blocks ``block_tables[j]`` of the growing ones. ``last_logits``: logits only at
        each chunk's last token."""
        lens = torch.tensor(lengths, device=device)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=device)
        cu[1:] = lens.cumsum(0)
        positions = torch.cat([torch.arange(s, s + n, device=device)
                               for s, n in zip(starts, lengths, strict=True)])
        tables = _pad_tables(block_tables, pad_block, device)
        seq = torch.arange(len(lengths), device=device).repeat_interleave(lens)
        blocks = tables[seq, positions // block_size] if tables.shape[1] else None
        offsets = positions % block_size
        return cls("prefill", positions, cu, buffers,
                   slots=torch.tensor(slots, dtype=torch.long, device=device),
                   slot_span=_span(slots), starts=tuple(starts), lengths=tuple(lengths),
                   block_tables=tables, block_size=block_size, token_blocks=blocks,
                   token_offsets=offsets, logits_at=cu[1:] - 1 if last_logits else None)

    @classmethod
    def decode(cls, slots: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               buffers: list[dict[str, torch.Tensor]], *, block_size: int,
               slot_span: slice | None = None,
               kv_spans: tuple | None = None, chain: bool = False) -> Context:
        """One token for each of B sequences: token b at ``positions[b]`` (the tokens its
        state already holds), state in row ``slots[b]``, blocks ``block_tables[b]`` [B, nb]
        (padded). Tensors only, so ``torch.compile`` traces it without graph breaks.
        ``kv_spans`` (eager only): :attr:`kv_spans`, which attention reads the rows by
        (:func:`hyla.ops.paged_attention.attend_spans`)."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        blocks = block_tables[rows, positions // block_size] if block_tables.shape[1] else None
        return cls("decode", positions, None, buffers, slots=slots, slot_span=slot_span,
                   block_tables=block_tables, block_size=block_size, token_blocks=blocks,
                   token_offsets=positions % block_size, kv_spans=kv_spans, chain=chain)

    def row(self, b: int) -> Context:
        """Decode: row ``b`` alone (its slot's fixed rows updated in place); one for every
        layer of the forward, so that its memo (rotary tables, ring masks) is shared."""
        key = ("row", b)
        if key not in self.memo:
            self.memo[key] = self._row(b)
        return self.memo[key]

    def _row(self, b: int) -> Context:
        slot = int(self.slots[b])
        return Context("decode", self.positions[b:b + 1], None, self.buffers,
                       slots=self.slots[b:b + 1], slot_span=slice(slot, slot + 1),
                       block_tables=self.block_tables[b:b + 1], block_size=self.block_size,
                       token_blocks=None if self.token_blocks is None
                       else self.token_blocks[b:b + 1],
                       token_offsets=self.token_offsets[b:b + 1],
                       kv_spans=None if self.kv_spans is None else self.kv_spans[b:b + 1])

    # -- state access for mixers -----------------------------------------------------------
    def load_fixed(self, buf: torch.Tensor) -> torch.Tensor:
        """The sequences' rows of a fixed buffer: a view when the slots are consecutive
        (updated in place), else a gathered copy (write it back with :meth:`store_fixed`)."""
        return buf[self.slot_span] if self.slot_span is not None else buf[self.slots]

    def store_fixed(self, buf: torch.Tensor, value: torch.Tensor) -> None:
        """Write the sequences' new rows of a fixed buffer (a no-op for the in-place view
        :meth:`load_fixed` gave)."""
        if self.slot_span is None:
            buf.index_copy_(0, self.slots, value)
        else:
            view = buf[self.slot_span]
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)

    def append_rows(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Store this step's new tokens' rows [tokens, *shape] in a paged growing buffer."""
        if self.kv_spans is not None:       # decode, places known as ints: plain row copies
            for b, (block, offset, _) in enumerate(self.kv_spans):
                buf[block, offset].copy_(rows[b])
            return
        buf[self.token_blocks, self.token_offsets] = rows.to(buf.dtype)

    def sequence_rows(self, buf: torch.Tensor, j: int, n: int, first: int = 0) -> torch.Tensor:
        """Rows ``first .. n - 1`` of sequence ``j`` in a paged growing buffer (a copy)."""
        pos = torch.arange(first, n, device=buf.device)
        return buf[self.block_tables[j, pos // self.block_size], pos % self.block_size]

    def batch_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """Decode: every sequence's blocks, concatenated: [B, blocks * block_size, *shape]
        (rows past a sequence's length are padding: mask them by ``positions``)."""
        return buf[self.block_tables].flatten(1, 2)


def _span(slots: list[int]) -> slice | None:
    first = slots[0] if slots else 0
    return slice(first, first + len(slots)) if list(slots) == list(
        range(first, first + len(slots))) else None


def _pad_tables(tables: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    out = torch.full((len(tables), width), pad, dtype=torch.long)
    for j, t in enumerate(tables):
        out[j, :len(t)] = torch.tensor(t, dtype=torch.long)
    return out.to(device)
