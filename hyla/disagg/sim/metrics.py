"""The metrics of one simulation run: TTFT and TPOT percentiles, throughput, goodput under
the SLOs, link use, offload and busy fractions (:func:`summarize`).

The simulator (:mod:`hyla.disagg.sim.model`) calls it at the end of a run; the searches over
runs (:mod:`hyla.disagg.sim.report`) read its dicts. It sits below both, so neither imports
the other back.
"""

from __future__ import annotations

from hyla.disagg.policy import LOCAL, REMOTE, recommend_pd_split
from hyla.disagg.sim.workload import Request


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
        "threshold_initial": dep.policy.threshold if dep.kind == "prfaas" else None,
        "threshold_final": sim.router.t if dep.kind == "prfaas" else None,
        "busy": {"local_prefill": bp, "decode": bd, "remote_prefill": busy(sim.remote_p)},
        "recommended_local_prefill": rec_split,
        "cached_tokens_frac": sum(x["cached"] for x in sim.rec.values())
        / max(1, sum(r.prompt_len for r in requests)),
        "local_routed": sum(1 for x in sim.rec.values() if x["cluster"] == LOCAL),
        "stopped_early": sim.stopped_early,
    }
