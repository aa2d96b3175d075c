"""Distributed Muon: optimizer bytes and Newton-Schulz FLOPs per rank, all_gather vs all_to_all.

Runs ``hyla bench muon-comm`` at W = 2, 4, 8 local gloo processes on laplace-3b's Muon
matrices (widths / 16 so the all_gather strategy's NS fits a CPU; every shape ratio kept), then
adds the planned figures at full width, including W = 48: the world size implied by the
reference run's 10.87 GB -> 0.45 GB (ratio ~24 = W/2). Prints a table, writes
benchmarks/results/muon_comm.json.

    python benchmarks/muon_comm.py [--worlds 2 4 8] [--width-divisor 16]
"""

from __future__ import annotations

import argparse

from hyla.perf import print_table, write_results
from hyla.train.comm import planned_traffic
from hyla.train.optim.comm_bench import muon_shapes, run_muon_comm

REFERENCE = {"all_gather_bytes": 10.87e9, "all_to_all_bytes": 0.45e9,
             "tokens_per_s": {"all_gather": 73378, "all_to_all": 119934}}


def _row(world, source, comm_dtype, strategies, analytic):
    ag, a2a = strategies["all_gather"], strategies["all_to_all"]
    return {"world": world, "source": source, "comm": comm_dtype,
            "all_gather GB": ag["bytes_per_rank"] / 1e9,
            "all_to_all GB": a2a["bytes_per_rank"] / 1e9,
            "ratio": ag["bytes_per_rank"] / a2a["bytes_per_rank"], "W/2": analytic,
            "NS TFLOP all_gather": ag["ns_flops_per_rank"] / 1e12,
            "NS TFLOP all_to_all": a2a["ns_flops_per_rank"] / 1e12}


def _planned(shapes, world, size):
    out = {}
    for s in ("all_gather", "all_to_all"):
        rows = planned_traffic(shapes, world, s, size)
        out[s] = {"bytes_per_rank": sum(r["sent"] for r in rows) / world,
                  "ns_flops_per_rank": max(r["ns_flops"] for r in rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--width-divisor", type=int, default=16)
    args = ap.parse_args()
    rows, runs = [], []
    for w in args.worlds:
        r = run_muon_comm(w, "laplace-3b", width_divisor=args.width_divisor)
        if not r["matches_plan"]:
            raise SystemExit(f"W={w}: measured bytes differ from the plan")
        runs.append(r)
        rows.append(_row(w, f"measured, width /{r['width_divisor']}", "fp32",
                         r["strategies"], r["analytic_ratio"]))
        rows.append(_row(w, "planned, full width", "fp32", r["full_scale"]["strategies"],
                         r["analytic_ratio"]))
    full = muon_shapes("laplace-3b")
    for size, name in ((4, "fp32"), (2, "bf16")):
        rows.append(_row(48, "planned, full width", name, _planned(full, 48, size), 24.0))
    print_table("Distributed Muon on laplace-3b: optimizer bytes sent per rank per step", rows)
    path = write_results("muon_comm", rows, runs=runs, reference=REFERENCE,
                         muon_params_full=sum(a * b for a, b in full),
                         note="bytes_per_rank = mean bytes a rank sends per step (= mean "
                              "received); NS FLOPs = busiest rank; param all-gather excluded")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
