"""Metrics of a simulation run, capacity under SLOs, and grid searches over t and P/D.

Throughput of a deployment is its *capacity*: the highest arrival rate at which at least
``attainment`` (90%) of requests meet both SLOs (TTFT <= ``ttft_base_s`` + incremental
prompt tokens / ``ttft_tok_s``; TPOT <= ``tpot_slo_s``), found by bisection on the rate
with the same request lengths. At a given rate, ``goodput_req_s`` counts the requests that
meet both SLOs per second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hyla.disagg.router import LOCAL, REMOTE, recommend_pd_split
from hyla.disagg.sim_workload import Request


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(sim, requests: list[Request]) -> dict:
    """The metrics dict of a finished :class:`hyla.disagg.sim.Sim`."""
    c = sim.cfg
    now = sim.env.now
    t0 = min(r.arrival for r in requests)
    dur = max(now - t0, 1e-9)
    ttft, tpot, good, tok, out_tok, n_done = [], [], 0, 0, 0, 0
    for r in requests:
        rec = sim.rec.get(str(r.rid))
        if rec is None or "first_token" not in rec:
            continue
        tt = rec["first_token"] - r.arrival
        ttft.append(tt)
        if "done" not in rec:
            continue
        n_done += 1
        tp = (rec["done"] - rec["first_token"]) / (r.output_len - 1) if r.output_len > 1 else 0
        tpot.append(tp)
        tok += r.prompt_len + r.output_len
        out_tok += r.output_len
        good += (tt <= c.ttft_base_s + rec["incremental"] / c.ttft_tok_s
                 and tp <= c.tpot_slo_s)
    n = len(requests)
    remote = sum(1 for x in sim.rec.values() if x["cluster"] == REMOTE)

    def busy(pool):
        return sum(i.busy_s for i in pool) / (len(pool) * dur) if pool else None
    bp, bd = busy(sim.local_p), busy(sim.decode)
    dep = sim.dep
    rec_split = None
    if dep.local_prefill and bp is not None:
        rec_split = recommend_pd_split(dep.local_instances, dep.local_prefill, min(bp, 1),
                                       min(bd, 1))
    return {
        "deployment": dep.name, "kind": dep.kind, "gpus": dep.gpus(),
        "local": f"{dep.local_instances} x {dep.local.label()} ({dep.local_prefill} prefill, "
                 f"{dep.local_instances - dep.local_prefill} decode)",
        "remote": f"{dep.remote_instances} x {dep.remote.label()}" if dep.remote else None,
        "requests": n, "completed": n_done, "sim_seconds": dur,
        "throughput_tok_s": tok / dur, "output_tok_s": out_tok / dur,
        "throughput_req_s": n_done / dur, "goodput_req_s": good / dur,
        "slo_attainment": good / n,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p90_s": _pct(tpot, 0.9),
        "egress_gbps": sim.egress_bytes * 8 / dur / 1e9,
        "link_utilisation": sim.egress_bytes * 8 / dur / 1e9 / c.link_gbps,
        "offload_fraction": remote / max(1, len(sim.rec)),
        "threshold_initial": dep.threshold if dep.kind == "prfaas" else None,
        "threshold_final": sim.router.t if dep.kind == "prfaas" else None,
        "busy": {"local_prefill": bp, "decode": bd, "remote_prefill": busy(sim.remote_p)},
        "recommended_local_prefill": rec_split,
        "cached_tokens_frac": sum(x["cached"] for x in sim.rec.values())
        / max(1, sum(r.prompt_len for r in requests)),
        "local_routed": sum(1 for x in sim.rec.values() if x["cluster"] == LOCAL),
    }


def simulate_one(model, dep, cfg, requests: list[Request]) -> dict:
    from hyla.disagg.sim import Sim

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
    for t in thresholds or [dep.threshold]:
        for n_p in splits:
            try:
                d = dataclasses.replace(dep, threshold=t, local_prefill=n_p)
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
