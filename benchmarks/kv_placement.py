"""Where a sequence's KV blocks lie no longer changes an eager decode step's attention, and
scattered blocks got faster, not slower.

One sequence's decode attention over 30 layers, SmolLM2-135M's shape (9 query heads, 3 KV
heads of 64, bf16 cache, blocks of 16), eager, one thread, at 256, 1,024 and 2,000 rows: its
blocks consecutive, in runs of 4 (a server whose free blocks have been handed round), and
scattered at random. ``attend_spans`` now copies several ranges into one, in the sequence's
order, and attends as over consecutive blocks (below ``LONG_SPAN_ROWS``, 2,048: every size
here); before, it summed range by range
(``attend_one_query`` over the pieces), whose order of sums followed the placement (here
over the ranges in the sequence's order; it sorted the blocks first, which merges only
blocks that touch: about as many ranges for these tables).
Reports ms a token and whether each placement's output equals the consecutive one's to the
bit. ``--quick``: 256 rows.
"""

import random

import torch

from hyla.ops.attention import attend_one_query
from hyla.ops.paged_attention import attend_spans, kv_spans

H, H_KV, D, BS, LAYERS, BLOCKS = 9, 3, 64, 16, 30, 2048


def per_range(q, keys, values, spans):
    """The step before: one range as now, several summed range by range (the placement's
    order)."""
    if len(spans[0][2]) == 1:
        return attend_spans(q, keys, values, spans)
    flat_k, flat_v = keys.flatten(0, 1), values.flatten(0, 1)
    ks = [flat_k[a:a + n] for a, n in spans[0][2]]
    vs = [flat_v[a:a + n] for a, n in spans[0][2]]
    return attend_one_query(q[0, 0].to(ks[0].dtype), ks, vs)


def tables(n: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    runs = [b for start in rng.sample(range(0, BLOCKS - 4, 4), -(-n // 4))
            for b in range(start, start + 4)][:n]
    return {"consecutive": list(range(100, 100 + n)), "runs of 4": runs,
            "scattered": rng.sample(range(BLOCKS), n)}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(BLOCKS, BS, H_KV, D, generator=g).bfloat16() for _ in range(LAYERS)]
    values = [torch.randn(BLOCKS, BS, H_KV, D, generator=g).bfloat16() for _ in range(LAYERS)]
    q = torch.randn(1, 1, H, D, generator=g)
    rows_out = []
    for rows in (256,) if run.args.quick else (256, 1024, 2000):
        n = rows // BS + 1
        first = None
        for name, table in tables(n).items():
            # the same rows wherever the table puts them
            ks, vs = [k.clone() for k in keys], [v.clone() for v in values]
            for k, v, k0, v0 in zip(ks, vs, keys, values, strict=True):
                k[table], v[table] = k0[:n], v0[:n]
            spans = kv_spans([table], [rows], BS)
            out = attend_spans(q, ks[0], vs[0], spans)
            first = out if first is None else first
            def step(attend, ks=ks, vs=vs, spans=spans):
                return 1e3 * run.median(lambda: [attend(q, k, v, spans)
                                                 for k, v in zip(ks, vs, strict=True)])
            ms = run.side_by_side({"now": lambda: step(attend_spans),
                                   "before": lambda: step(per_range)})
            rows_out.append({"rows": rows, "placement": name, "ranges": len(spans[0][2]),
                             "now_ms": ms["now"]["median"], "before_ms": ms["before"]["median"],
                             "bitwise_equal_to_consecutive": bool(torch.equal(out, first))})
    run.table(f"eager decode attention, one sequence, {LAYERS} layers, one thread (ms)",
              rows_out)
    worst = max(rows_out, key=lambda r: r["before_ms"])
    equal = all(r["bitwise_equal_to_consecutive"] for r in rows_out)
    run.save(rows_out, summary=(
        f"every placement bitwise equal: {equal}; "
        f"{worst['rows']} rows {worst['placement']}: {worst['now_ms']:.1f} ms now against "
        f"{worst['before_ms']:.1f} before"))
