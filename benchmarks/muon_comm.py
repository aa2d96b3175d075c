"""Distributed Muon's all_to_all sends W/2 times fewer optimizer bytes a rank than all_gather.

Measured at W = 2, 4, 8 gloo processes on laplace-3b's Muon matrices (widths / 16, shape
ratios kept) against the planner: fp32 bytes a rank sends a step and the busiest rank's
Newton-Schulz FLOPs; then planned at full width and at W = 48, the world size the reference
run's 10.87 -> 0.45 GB implies. ``--quick``: W = 2.
"""

from hyla.train.optim.bench import muon_shapes, run_muon_comm
from hyla.train.optim.comm import planned_traffic

REFERENCE = {"all_gather_bytes": 10.87e9, "all_to_all_bytes": 0.45e9,
             "tokens_per_s": {"all_gather": 73378, "all_to_all": 119934}}


def add_args(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])


def row(world, source, comm, strategies, analytic) -> dict:
    ag, a2a = strategies["all_gather"], strategies["all_to_all"]
    return {"world": world, "source": source, "comm": comm,
            "all_gather GB": ag["bytes_per_rank"] / 1e9,
            "all_to_all GB": a2a["bytes_per_rank"] / 1e9,
            "ratio": ag["bytes_per_rank"] / a2a["bytes_per_rank"], "W/2": analytic,
            "NS TFLOP all_gather": ag["ns_flops_per_rank"] / 1e12,
            "NS TFLOP all_to_all": a2a["ns_flops_per_rank"] / 1e12}


def main(run) -> None:
    rows, runs = [], []
    for w in [2] if run.args.quick else run.args.worlds:
        run.progress(f"W={w}")
        r = run_muon_comm(w, "laplace-3b", width_divisor=16)
        if not r["matches_plan"]:
            raise SystemExit(f"W={w}: measured bytes differ from the plan")
        runs.append(r)
        rows += [row(w, "measured, width /16", "fp32", r["strategies"], r["analytic_ratio"]),
                 row(w, "planned, full width", "fp32", r["full_scale"]["strategies"],
                     r["analytic_ratio"])]
    full = muon_shapes("laplace-3b")
    for size, name in ((4, "fp32"), (2, "bf16")):
        plan = {s: planned_traffic(full, 48, s, size) for s in ("all_gather", "all_to_all")}
        per_rank = {s: {"bytes_per_rank": sum(x["sent"] for x in p) / 48,
                        "ns_flops_per_rank": max(x["ns_flops"] for x in p)}
                    for s, p in plan.items()}
        rows.append(row(48, "planned, full width", name, per_rank, 24.0))
    run.table("Distributed Muon on laplace-3b: optimizer bytes sent a rank a step", rows)
    run.save(rows, runs=runs, reference=REFERENCE, muon_params_full=sum(a * b for a, b in full),
             note="bytes_per_rank = mean bytes a rank sends a step (= mean received); NS FLOPs "
                  "= busiest rank; parameter all-gather excluded",
             summary="all_gather vs all_to_all GB a rank a step (fp32, full width): " + ", ".join(
                 f"W={r['world']} {r['all_gather GB']:.2f} vs {r['all_to_all GB']:.3g}"
                 for r in rows if r["source"][0] == "p" and r["comm"] == "fp32")
             + "; measured bytes equal the plan")
