"""Claim: one decode query over a long KV cache laid out as paged blocks is faster as two
GEMMs over the rows as they lie (``hyla.ops.attention.attend_one_query``) than as SDPA on a
strided ``[H_kv, rows, D]`` view of them, from about 2K rows (where the engine switches).

SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64), one decode token, 30 layers' worth
of distinct caches so nothing stays in cache between layers (as in a real step), one thread.
Each contender is timed over the 30 layers, median of the repeats, side by side per length
and KV dtype.

    python benchmarks/long_kv_attention.py            # 1K, 2K, 4K, 16K rows
    python benchmarks/long_kv_attention.py --quick    # seconds

Writes ``benchmarks/results/long_kv_attention.json`` (``..._quick.json`` with --quick).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hyla.ops.attention import attend_one_query
from hyla.perf import print_table, time_fn, write_results

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def _contenders(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """(SDPA on the strided views, attend_one_query) over every layer's cache."""
    grouped = q.view(1, KV_HEADS, HEADS // KV_HEADS, DIM)

    def sdpa():
        for k, v in caches:
            F.scaled_dot_product_attention(grouped, k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None])

    def gemms():
        for k, v in caches:
            attend_one_query(q, [k], [v])

    return sdpa, gemms


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1024,2048,4096,16384",
                   help="comma-separated cache lengths (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default: 5)")
    p.add_argument("--quick", action="store_true", help="256 and 1,024 rows, 3 repeats")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.rows, args.repeats = "256,1024", 3
    rows = []
    with torch.inference_mode():
        for n in (int(x) for x in args.rows.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                caches = [(torch.randn(n, KV_HEADS, DIM).to(dtype),
                           torch.randn(n, KV_HEADS, DIM).to(dtype)) for _ in range(LAYERS)]
                q = torch.randn(HEADS, DIM).to(dtype)
                sdpa, gemms = _contenders(q, caches)
                t_sdpa = time_fn(sdpa, repeats=args.repeats)
                t_gemm = time_fn(gemms, repeats=args.repeats)
                rows.append({"rows": n, "kv_dtype": str(dtype).removeprefix("torch."),
                             "sdpa_ms": round(t_sdpa * 1e3, 1),
                             "gemms_ms": round(t_gemm * 1e3, 1),
                             "speedup": round(t_sdpa / t_gemm, 2)})
                print(rows[-1], flush=True)
    print_table(f"one decode query over {LAYERS} layers' KV caches, 1 thread", rows)
    path = write_results("long_kv_attention_quick" if args.quick else "long_kv_attention", rows,
                         params={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                                 "layers": LAYERS, "repeats": args.repeats})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
