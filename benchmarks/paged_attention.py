"""Decode attention of a compiled step over the paged KV cache, two ways.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64, bf16 cache, blocks of 16),
30 layers in one compiled function: 16 sequences at 96 and 256 cached rows a sequence, one
at 96, 1,024, 4,096 and 16,384:

- ``op``: ``hyla::paged_decode_attention`` (inside one custom op: up to 8 sequences each
  one's rows read in place, wider batches gathered bf16 products);
- ``fused``: :func:`hyla.ops.paged_attention.attend_fused`, products and sums inductor fuses
  with the gather (what a compiled step runs up to ``FUSED_MAX_ROWS`` rows, the op beyond).

One thread, the variants alternating in one process over several rounds, medians of ms for
the 30 layers, and each one's largest difference from the op's output.

    python benchmarks/paged_attention.py [--rounds 3]

Writes benchmarks/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch

from hyla.ops.paged_attention import attend_fused, paged_decode_attention
from hyla.perf import machine_info

RESULTS = pathlib.Path(__file__).parent / "results" / "paged_attention.json"
H, H_KV, D, BS, LAYERS = 9, 3, 64, 16, 30


def layers_of(attend, keys, values):
    def run(q, tables, positions):
        out = q
        for k, v in zip(keys, values, strict=True):
            out = out + attend(q, k, v, tables, positions)
        return out
    return run


def median_ms(fn, *args, repeats: int = 15) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def case(B: int, blocks: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    pool = B * blocks + 1
    keys = [torch.randn(pool, BS, H_KV, D, generator=g).bfloat16() for _ in range(LAYERS)]
    values = [torch.randn(pool, BS, H_KV, D, generator=g).bfloat16() for _ in range(LAYERS)]
    tables = torch.arange(B * blocks).view(B, blocks)
    positions = torch.full((B,), blocks * BS - 3)
    q = torch.randn(B, 1, H, D, generator=g)
    variants = {"op": paged_decode_attention, "fused": attend_fused}
    fns, build_s = {}, {}
    with torch.inference_mode():
        want = layers_of(paged_decode_attention, keys, values)(q, tables, positions)
        for name, attend in variants.items():
            torch._dynamo.mark_dynamic(tables, 1)
            fns[name] = torch.compile(layers_of(attend, keys, values), dynamic=False)
            began = time.perf_counter()
            got = fns[name](q, tables, positions)
            build_s[name] = time.perf_counter() - began
            build_s[name + " max abs diff"] = (got - want).abs().max().item()
        ms: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                ms[name].append(median_ms(fns[name], q, tables, positions))
    row = {"batch": B, "rows": blocks * BS,
           "ms_30_layers": {n: statistics.median(v) for n, v in ms.items()}, "rounds_ms": ms,
           "build_s_and_error": build_s}
    print(json.dumps({k: row[k] for k in ("batch", "rows", "ms_30_layers")}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [case(16, blocks, args.rounds) for blocks in (6, 16)]
    rows += [case(1, blocks, args.rounds) for blocks in (6, 64, 256, 1024)]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": 1,
                                   "load": os.getloadavg(), "layers": LAYERS,
                                   "rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
