"""Decode attention over paged KV blocks, read in place: one new query per sequence.

The engine keeps keys and values in blocks ``[blocks, block_size, H_kv, D]`` and each
sequence's block table says which blocks are its. A decode step's query sees every row of its
sequence: :func:`kv_spans` turns a table into ranges of the flattened buffer, in the
sequence's order (one, when the blocks are consecutive), and :func:`attend_spans` attends to
one range as a view, with no gathered copy. Below ``LONG_SPAN_ROWS`` it copies several
ranges into one first, so that where the blocks lie does not change the arithmetic (a greedy
token at a near-tie once changed after a server's free blocks had been handed round once);
longer sequences read their ranges in place, sorted and merged where blocks touch (blocks
handed out in descending order are then two views, not a copy of every row a token).

:func:`paged_decode_attention` is the same as one op that ``torch.compile`` keeps whole
(``hyla::paged_decode_attention``): a compiled decode step reads the cache in place too, and
its graph does not depend on how long the sequences are, so one graph serves every context
length. Compiled steps over tables of up to ``FUSED_MAX_ROWS`` rows take
:func:`attend_fused` instead, products and sums that inductor fuses with the gather (the
block tables' length symbolic: one graph for all of them, another for longer tables).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.attention import attend_one_query

# From this many cached rows a sequence's KV span is read with attend_one_query (two GEMMs)
# instead of SDPA (measured crossover: 1K-4K rows); scattered rows always go there
LONG_SPAN_ROWS = 2048

# Decode batches up to this many sequences read their KV rows in place, one attention call
# a sequence (attend_spans); wider ones gather them into one batched product (attend_gathered)
SPAN_MAX_BATCH = 8

# A compiled step takes attend_fused for block tables of up to this many rows, the op beyond:
# its loops are 2.4-4x faster up to 2,048 rows a sequence and fall off a cliff past them
# (30 layers, one thread: one sequence at 2,048 rows 10.7 against 26.1 ms, at 4,096 216
# against 35; 16 at 1,024 78 against 261, at 2,048 3,965 against 596;
# benchmarks/paged_attention.py)
FUSED_MAX_ROWS = 2048

Spans = tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]


def kv_spans(tables: list[list[int]], positions: list[int], block_size: int) -> Spans:
    """Where each sequence's KV rows lie, for a decode step that reads them in place: the
    block and offset its new token's row goes to, and the row ranges (first row, rows) of
    the flattened paged buffer ``[blocks * block_size, ...]`` that hold its rows up to that
    one, in the sequence's order (blocks that follow one another in the buffer too make
    one range).

    Example:
        >>> kv_spans([[4, 5, 6], [0]], [40, 3], 16)
        ((6, 8, ((64, 41),)), (0, 3, ((0, 4),)))
        >>> kv_spans([[9, 4, 5]], [40], 16)     # block 9, then blocks 4, 5 (25 rows)
        ((5, 8, ((144, 16), (64, 25))),)
    """
    out = []
    for table, pos in zip(tables, positions, strict=True):
        n = pos // block_size + 1
        last, tail = table[n - 1], pos % block_size + 1
        ranges: list[list[int]] = []
        for i, block in enumerate(table[:n]):
            rows = tail if i == n - 1 else block_size
            if ranges and sum(ranges[-1]) == block * block_size:
                ranges[-1][1] += rows
            else:
                ranges.append([block * block_size, rows])
        out.append((last, tail - 1, tuple((a, b) for a, b in ranges)))
    return tuple(out)


def _merged(ranges) -> list[tuple[int, int]]:
    """``ranges`` (first row, rows) sorted by place, those that touch made one."""
    out: list[list[int]] = []
    for first, rows in sorted(ranges):
        if out and sum(out[-1]) == first:
            out[-1][1] += rows
        else:
            out.append([first, rows])
    return [(a, n) for a, n in out]


def attend_spans(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 spans: Spans) -> torch.Tensor:
    """q [B, 1, H, D] attends, per sequence, to the rows ``spans`` name (:func:`kv_spans`)
    of the paged ``keys`` [blocks, block_size, H_kv, D] and ``values`` (..., Dv), all of them
    visible, softmax scale 1 / sqrt(D) -> [B, 1, H, Dv] in q's dtype. The query heads sharing
    a KV head become that head's rows (GQA without repeating keys)."""
    B, _, H, D = q.shape
    flat_k, flat_v = keys.flatten(0, 1), values.flatten(0, 1)
    h_kv = keys.shape[-2]
    outs = []
    for b in range(B):
        ranges = spans[b][2]
        qb = q[b, 0] if q.dtype is flat_k.dtype else q[b, 0].to(flat_k.dtype)
        if sum(n for _, n in ranges) >= LONG_SPAN_ROWS:
            # long: read where they lie, sorted and merged where blocks touch (a copy a token
            # would cost more than the attention; the order of the sums then follows the
            # placement, so a near-tie may part from a consecutive placement's)
            pieces = _merged(ranges)
            outs.append(attend_one_query(qb, [flat_k[a:a + n] for a, n in pieces],
                                         [flat_v[a:a + n] for a, n in pieces])
                        .view(h_kv, H // h_kv, -1))
            continue
        # several ranges: copied into one, in the sequence's order, so that the sums run as
        # they would over one range (the same rows, wherever they lie, give the same output
        # to the bit; and faster than a sum a range)
        ks = [flat_k[first:first + rows] for first, rows in ranges]
        vs = [flat_v[first:first + rows] for first, rows in ranges]
        k, v = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))
        # 4-D [1, Hkv, rows, D]: what the fused CPU kernel takes (3-D goes the slow way)
        outs.append(F.scaled_dot_product_attention(
            qb.reshape(1, h_kv, H // h_kv, D), k.transpose(0, 1)[None],
            v.transpose(0, 1)[None])[0])
    return torch.stack(outs).reshape(B, 1, H, -1).to(q.dtype)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """As :func:`attend_spans`, for many sequences at once: their blocks up to the longest
    one's last row gathered into ``[B, rows, H_kv, D]``, scored against the query heads of
    each KV head in the cache's dtype (fp32 softmax), rows past a sequence's position masked.

    Wide decode batches: one batched product instead of a call a sequence, and no masked SDPA
    (at 16 sequences of 80 rows: 0.27 against 0.9-1 ms a layer, one thread).
    """
    B, _, H, D = q.shape
    bs, h_kv = keys.shape[1], keys.shape[-2]
    n = int(positions.max()) // bs + 1
    k = keys[block_tables[:, :n]].flatten(1, 2)                   # [B, n * bs, H_kv, D]
    v = values[block_tables[:, :n]].flatten(1, 2)
    qg = q.view(B, h_kv, H // h_kv, D).to(k.dtype)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float()      # [B, H_kv, G, rows]
    hidden = torch.arange(n * bs, device=q.device) > positions[:, None]
    probs = scores.mul_(D ** -0.5).masked_fill_(hidden[:, None, None], float("-inf"))
    out = torch.matmul(probs.softmax(-1).to(v.dtype), v.transpose(1, 2))
    return out.reshape(B, 1, H, -1).to(q.dtype)


# A region of its own: inside the step's graph, inductor would fuse the query's projection
# epilogue and rotary into the score loop and recompute them for every cached row (4.3 ms a
# layer at 16 sequences); as a region, the query is stored once. The 30 layers also share
# one compiled region.
@torch.compiler.nested_compile_region
def attend_fused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """As :func:`attend_gathered`, written for ``torch.compile``: every block of the padded
    tables, rows past a sequence's position masked, in fp32 products and sums (not matmuls),
    which inductor fuses with the blocks' gather into loops that read the cache in place.
    Eagerly it would materialise every product: compiled code only.

    Wide compiled batches: 16 sequences, 30 layers of SmolLM2's shape took 10.4 ms against
    31.2 through :func:`paged_decode_attention` at 96 rows a sequence, 22.9 against 74.1 at
    256 (``benchmarks/paged_attention.py``). Every sequence costs the longest one's rows.
    """
    B, _, H, D = q.shape
    h_kv = keys.shape[-2]
    k = keys[block_tables].flatten(1, 2)                  # [B, rows, H_kv, D]: fused, no copy
    v = values[block_tables].flatten(1, 2)
    qg = q.float().view(B, 1, h_kv, H // h_kv, D)
    scores = (qg * k[:, :, :, None].float()).sum(-1).mul(D ** -0.5)    # [B, rows, H_kv, G]
    hidden = torch.arange(k.shape[1], device=q.device) > positions[:, None]
    probs = scores.masked_fill(hidden[:, :, None, None], float("-inf")).softmax(1)
    out = (probs[..., None] * v[:, :, :, None].float()).sum(1)        # [B, H_kv, G, Dv]
    return out.reshape(B, 1, H, -1).to(q.dtype)


def attend_compiled(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Decode attention inside a compiled step: block tables of up to ``FUSED_MAX_ROWS``
    rows through :func:`attend_fused`, longer ones through :func:`paged_decode_attention`,
    which reads each sequence's own rows (for up to SPAN_MAX_BATCH sequences; a long context
    costs its own rows, not the longest one's). The tables' length is symbolic when traced:
    the test below is a guard, so each side is a graph of its own (the runner's warm-up
    builds both)."""
    if block_tables.shape[1] * keys.shape[1] <= FUSED_MAX_ROWS:
        return attend_fused(q, keys, values, block_tables, positions)
    return paged_decode_attention(q, keys, values, block_tables, positions)


@torch.library.custom_op("hyla::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`attend_spans` for sequences given by their padded ``block_tables`` [B, nb] and
    ``positions`` [B] (the new token's; its row must already be written), as one op.

    Example:
        >>> keys, values = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
        >>> q = torch.randn(1, 1, 4, 8)
        >>> out = paged_decode_attention(q, keys, values, torch.tensor([[2, 0]]),
        ...                              torch.tensor([5]))
        >>> rows = torch.cat([keys[2], keys[0, :2]]), torch.cat([values[2], values[0, :2]])
        >>> ref = F.scaled_dot_product_attention(q[0, 0].view(2, 2, 8),
        ...     rows[0].transpose(0, 1), rows[1].transpose(0, 1))
        >>> torch.allclose(out.view(2, 2, 8), ref, atol=1e-5)
        True
    """
    if q.shape[0] > SPAN_MAX_BATCH:
        return attend_gathered(q, keys, values, block_tables, positions)
    spans = kv_spans(block_tables.tolist(), positions.tolist(), keys.shape[1])
    return attend_spans(q, keys, values, spans)


@paged_decode_attention.register_fake
def _(q, keys, values, block_tables, positions):
    return q.new_empty(*q.shape[:3], values.shape[-1])
