"""Capacity under SLOs, and grid searches over t and P/D (a run's metrics:
:mod:`hyla.disagg.sim.metrics`).

Throughput of a deployment is its *capacity*: the highest arrival rate at which at least
``attainment`` (90%) of requests meet both SLOs (TTFT <= ``ttft_base_s`` + incremental
prompt tokens / ``ttft_tok_s``; TPOT <= ``tpot_slo_s``), found by bisection on the rate
with the same request lengths. At a given rate, ``goodput_req_s`` counts the requests that
meet both SLOs per second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hyla.disagg.sim.model import Sim
from hyla.disagg.sim.workload import Request


def simulate_one(model, dep, cfg, requests: list[Request]) -> dict:
    """The metrics of one run of ``requests`` on ``dep``."""
    return Sim(model, dep, cfg).run(requests)


def capacity(model, dep, cfg, make: Callable[[float], list[Request]], lo: float, hi: float,
             *, attainment: float = 0.9, iters: int = 6) -> tuple[float, dict]:
    """Highest rate in [lo, hi] whose run meets ``attainment``; (rate, metrics at it).

    ``make(rate)`` returns the workload at that rate. If even ``lo`` fails, returns ``lo``
    and its metrics (with ``meets_slo`` False).
    """
    best, best_m = None, None
    m_lo = simulate_one(model, dep, cfg, make(lo))
    if m_lo["slo_attainment"] < attainment:
        return lo, {**m_lo, "meets_slo": False, "rate_req_s": lo}
    best, best_m = lo, m_lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        m = simulate_one(model, dep, cfg, make(mid))
        if m["slo_attainment"] >= attainment:
            lo, best, best_m = mid, mid, m
        else:
            hi = mid
    return best, {**best_m, "meets_slo": True, "rate_req_s": best}


def grid(model, dep, cfg, requests: list[Request], thresholds: list[int] | None,
         splits: list[int]) -> list[dict]:
    """Goodput at one workload for every (threshold, local prefill instances) pair.

    ``thresholds=None`` varies only the split (homogeneous). Rows: threshold, local_prefill,
    goodput_req_s, slo_attainment, ttft_p90_s, egress_gbps, offload_fraction.
    """
    rows = []
    for t in thresholds or [dep.policy.threshold]:
        for n_p in splits:
            try:
                d = dataclasses.replace(dep, local_prefill=n_p, policy=dataclasses.replace(
                    dep.policy, threshold=t))
            except ValueError:
                continue
            m = simulate_one(model, d, cfg, requests)
            rows.append({"threshold": t if thresholds else None, "local_prefill": n_p,
                         **{k: m[k] for k in ("goodput_req_s", "slo_attainment",
                                              "ttft_p90_s", "egress_gbps",
                                              "offload_fraction", "throughput_tok_s")}})
    return rows


def best_of(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["goodput_req_s"], -(r["ttft_p90_s"] or 0)))
