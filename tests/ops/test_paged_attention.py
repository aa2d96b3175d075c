"""Decode attention over paged KV blocks: read in place per sequence (attend_spans), gathered
for wide batches (attend_gathered), as the products and sums a compiled wide batch fuses
(attend_fused), and as one op torch.compile keeps whole, all against
SDPA over each sequence's rows gathered by hand; blocks in any order, GQA, a bf16 cache.

Compiled, the op is tested in tests/serve/test_compiled_decode.py (one graph for every
context length): torch.compile here, before test_streamkl_triton, would import triton
outside that file's interpreter mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyla.ops.paged_attention import (
    SPAN_MAX_BATCH,
    attend_fused,
    attend_gathered,
    attend_spans,
    kv_spans,
    paged_decode_attention,
)

BS, H, H_KV, D = 4, 6, 2, 8


def _case(dtype, batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = 8 * batch
    keys = torch.randn(blocks + 1, BS, H_KV, D, generator=g).to(dtype)
    values = torch.randn(blocks + 1, BS, H_KV, D, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()          # blocks in any order
    tables = torch.tensor([order[8 * b:8 * b + 8] for b in range(batch)])
    positions = torch.randint(0, 8 * BS, (batch,), generator=g)
    q = torch.randn(batch, 1, H, D, generator=g)
    return q, keys, values, tables, positions


def _reference(q, keys, values, tables, positions):
    outs = []
    for b in range(q.shape[0]):
        rows = torch.arange(int(positions[b]) + 1)
        k = keys[tables[b, rows // BS], rows % BS].float()          # [rows, H_kv, D]
        v = values[tables[b, rows // BS], rows % BS].float()
        outs.append(F.scaled_dot_product_attention(
            q[b, 0].view(H_KV, H // H_KV, D), k.transpose(0, 1), v.transpose(0, 1)))
    return torch.stack(outs).reshape(q.shape[0], 1, H, D)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_spans_gathered_and_the_op_give_sdpa_over_each_sequences_rows(dtype, tol):
    q, keys, values, tables, positions = _case(dtype)
    want = _reference(q, keys, values, tables, positions)
    spans = kv_spans(tables.tolist(), positions.tolist(), BS)
    for got in (attend_spans(q, keys, values, spans),
                attend_gathered(q, keys, values, tables, positions),
                attend_fused(q, keys, values, tables, positions),
                paged_decode_attention(q, keys, values, tables, positions)):
        assert got.dtype == q.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_a_wide_batch_takes_the_gathered_product():
    q, keys, values, tables, positions = _case(torch.float32, batch=SPAN_MAX_BATCH + 2)
    torch.testing.assert_close(paged_decode_attention(q, keys, values, tables, positions),
                               _reference(q, keys, values, tables, positions),
                               rtol=1e-5, atol=1e-5)


def test_where_the_blocks_lie_does_not_change_the_output():
    """One sequence's rows in consecutive blocks, in blocks handed out of order, and in a
    batch beside another: the same output to the bit (found by a hostile client: a server
    whose free blocks had been handed round once parted from its greedy text at a near-tie,
    as scattered rows took another sum order)."""
    g = torch.Generator().manual_seed(0)
    blocks, n, pos = 24, 6, 5 * BS + 3
    keys = torch.randn(blocks, BS, H_KV, D, generator=g, dtype=torch.float32).bfloat16()
    values = torch.randn(blocks, BS, H_KV, D, generator=g, dtype=torch.float32).bfloat16()
    q = torch.randn(1, 1, H, D, generator=g)
    outs = []
    for table in ([0, 1, 2, 3, 4, 5], [17, 3, 9, 10, 22, 6], [11, 10, 9, 8, 7, 6]):
        k, v = keys.clone(), values.clone()
        k[table], v[table] = keys[:n], values[:n]        # the same rows, placed by the table
        outs.append(attend_spans(q, k, v, kv_spans([table], [pos], BS)))
        other = [[12, 13], table]                          # beside another sequence
        two = attend_spans(q.expand(2, -1, -1, -1), k, v, kv_spans(other, [BS + 1, pos], BS))
        outs.append(two[1:])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_long_scattered_sequences_read_their_blocks_in_place(monkeypatch):
    """Past LONG_SPAN_ROWS the ranges are read where they lie (blocks handed out in
    descending order: two views, no copy of every row), close to the consecutive output."""
    import hyla.ops.paged_attention as paged

    monkeypatch.setattr(paged, "LONG_SPAN_ROWS", 8)
    calls = []
    real = paged.attend_one_query
    monkeypatch.setattr(paged, "attend_one_query", lambda q, ks, vs: calls.append(len(ks))
                        or real(q, ks, vs))
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(24, BS, H_KV, D, generator=g), torch.randn(24, BS, H_KV, D,
                                                                           generator=g)
    q, n, pos = torch.randn(1, 1, H, D, generator=g), 6, 5 * BS + 3
    want = attend_spans(q, keys, values, kv_spans([list(range(n))], [pos], BS))
    k, v = keys.clone(), values.clone()
    table = [11, 10, 9, 8, 7, 6]
    k[table], v[table] = keys[:n], values[:n]
    got = attend_spans(q, k, v, kv_spans([table], [pos], BS))
    assert calls == [1, 1]          # the descending blocks merged into one view
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
