"""Claim (issue 18): what makes the published setup's capacity ratios hold from seed to seed.

Fixed configurations (homogeneous PD with 11 of 12 instances prefilling; PrfaaS at t = 19K
with 7 of 8 local instances prefilling; naive), no policy search, 5 seeds, capacity under
the SLOs by bisection to 1%, ratios per seed on the same arrivals. Three workload variants
of the published synthetic mix, side by side:

- 400 requests a run (at least rate x 120 s), independent draws (the earlier default);
- 1,600 requests a run (at least rate x 480 s), independent draws;
- 1,600 requests a run, lengths and follow-up choices stratified in blocks of 100
  (``SyntheticMix.stratify``, the default now).

Simulated, not measured.

    python benchmarks/disagg_variance.py        # about 20 minutes on 2 cores

Writes ``benchmarks/results/disagg_variance.json``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

from hyla.disagg.sim.capacity import compare_capacity
from hyla.disagg.sim.hardware import published_1t_hybrid
from hyla.disagg.sim.setups import published_deployments, workload_maker
from hyla.disagg.sim.workload import SyntheticMix
from hyla.perf import print_table, write_results

VARIANTS = {"400 independent": (400, 120.0, 1), "1,600 independent": (1600, 480.0, 1),
            "1,600 stratified": (1600, 480.0, SyntheticMix().stratify)}


def run_variant(name: str) -> dict:
    n, min_duration, block = VARIANTS[name]
    mix = dataclasses.replace(SyntheticMix(), stratify=block)
    deps = published_deployments(prfaas_prefill=7, threshold=19_000, homo_prefill=11)
    t0 = time.time()
    res = compare_capacity(published_1t_hybrid(), deps, lambda seed: workload_maker(
        mix=mix, num_requests=n, seed=seed, min_duration_s=min_duration),
        seeds=list(range(5)), search=False, rel_tol=0.01)
    row = {"variant": name, "requests": n, "stratify": block}
    for k, iv in res["deployments"].items():
        row[f"{k}_req_s"] = iv["capacity"]["mean"]
        row[f"{k}_rel_half"] = iv["capacity"]["rel_half"]
    for k in ("prfaas_vs_homogeneous", "prfaas_vs_naive"):
        row[k] = res["ratios"][k]["mean"]
        row[f"{k}_rel_half"] = res["ratios"][k]["rel_half"]
    row["wall_s"] = time.time() - t0
    return {"row": row, "detail": res}


def main() -> None:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        out = pool.map(run_variant, list(VARIANTS))
    rows = [o["row"] for o in out]
    print_table("Capacity over 5 seeds by workload variant (95% interval / mean)",
                [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                 for r in rows])
    path = write_results("disagg_variance", rows, details=[o["detail"] for o in out],
                         note="simulated, not measured; fixed configurations, no search")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
