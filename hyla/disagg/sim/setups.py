"""Named setups for the simulator and the comparison it reports.

``published``: the PrfaaS case study, as far as it is published, with our assumptions for
the rest (:data:`PUBLISHED_INPUTS` lists which is which). Deployments of equal GPU count:

- homogeneous PD: 96 H20 (12 instances of 8), split into prefill and decode instances;
- naive heterogeneous: 32 H200 (4 instances) prefill everything, 64 H20 (8) decode;
- PrfaaS: the same 32 H200 as a remote prefill cluster, 64 H20 as a local PD cluster,
  threshold router in front.

:func:`compare` runs the chosen deployments on one workload, either at a fixed rate or
at each one's capacity (the highest rate meeting the SLOs, bisection).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hyla.disagg.policy import RouterConfig
from hyla.disagg.sim.hardware import InstanceProfile, ModelSpec
from hyla.disagg.sim.model import Deployment, SimConfig
from hyla.disagg.sim.report import capacity, simulate_one
from hyla.disagg.sim.workload import Request, SyntheticMix, load_trace

PUBLISHED_INPUTS = {
    "published": [
        "model: 1T parameters, hybrid 7:1 linear:full attention, MLA full attention",
        "prefill cluster: 32 H200; local PD cluster: 64 H20; baseline: 96 H20 PD",
        "link: ~100 Gbps between clusters",
        "routing threshold t = 19.4K incremental tokens, ~50% of requests offloaded",
        "GPU peaks: H200 989 TFLOP/s bf16, 4.8 TB/s, 141 GB; H20 148 TFLOP/s, 4.0 TB/s, 96 GB",
    ],
    "assumed": [
        "model: 50B active parameters, 80 layers (70 linear + 10 MLA), MLA cache 576 bf16 "
        "values a token a layer, 64 x 128 x 128 fp32 linear state a layer, 4-bit weights",
        "an instance is 8 GPUs; prefill at 45% of peak FLOP/s, decode at 80% of peak HBM "
        "bandwidth, 2 ms overhead a step; 10% of memory reserved",
        "workload: synthetic (the paper's trace is not public): log-normal prompts, median "
        "28K tokens; 25% follow-up turns reusing the previous context; outputs median 600",
        "SLOs: TTFT <= 2 s + incremental tokens / 2,000 tok/s, TPOT <= 100 ms, 90% of requests",
        "link latency 5 ms, FIFO; intra-cluster transfer 400 Gbps without contention; prefix "
        "caches unbounded; router observes every 5 s",
    ],
}


# Published: naive heterogeneous serves 1.16x homogeneous PD (and PrfaaS 1.54x homogeneous,
# 1.32x naive). With datasheet peaks and one MFU for both GPUs, an H200 prefills ~6.7x
# faster than an H20 and naive comes out ~2.9x homogeneous: the published ratio implies a
# much smaller effective prefill advantage for the H200 cluster.
PUBLISHED_NAIVE_VS_HOMOGENEOUS = 1.16


def published_deployments(*, homo_prefill: int = 10, prfaas_prefill: int = 3,
                          threshold: int = 19_400, adapt: bool = True,
                          remote_mfu: float = 0.45) -> dict[str, Deployment]:
    """The three deployments of the case study (instance splits: our grid's choice).
    ``remote_mfu``: the H200 prefill cluster's achieved fraction of peak FLOP/s."""
    h20, h200 = InstanceProfile(gpu="H20"), InstanceProfile(gpu="H200", mfu=remote_mfu)
    return {
        "homogeneous": Deployment(name="homogeneous", kind="homogeneous", local=h20,
                                  local_instances=12, local_prefill=homo_prefill),
        "naive": Deployment(name="naive", kind="naive", local=h20, local_instances=8,
                            local_prefill=0, remote=h200, remote_instances=4),
        "prfaas": Deployment(name="prfaas", kind="prfaas", local=h20, local_instances=8,
                             local_prefill=prfaas_prefill, remote=h200, remote_instances=4,
                             policy=RouterConfig(threshold=threshold, adapt=adapt)),
    }


def workload_maker(*, trace: str | None = None, length_scale: float = 1.0,
                   output_scale: float = 1.0, arrivals: str = "poisson", cv: float = 2.0,
                   num_requests: int = 400, seed: int = 0, min_duration_s: float = 0.0,
                   mix: SyntheticMix | None = None) -> Callable[[float], list[Request]]:
    """``make(rate) -> requests``: the trace (or the synthetic ``mix``, default the published
    setup's) at ``rate`` requests/s.

    Lengths do not depend on the rate, and arrival times scale with it (the same seed: the
    same pattern), so capacities compare like with like. ``min_duration_s``: at least
    ``rate * min_duration_s`` requests (more than ``num_requests`` at high rates), so that a
    run lasts long enough for queues to reach steady state; the first ``num_requests`` are
    the same at every rate. ``seed`` draws the arrivals and the synthetic lengths, and picks
    the trace window (seed 0: the trace's start).
    """
    def n_at(rate):
        return max(num_requests, math.ceil(rate * min_duration_s))
    if trace is None:
        mix = mix or SyntheticMix()
        return lambda rate: mix.generate(n_at(rate), rate, arrivals, cv, seed)
    skip = (seed * 3989) % 9973

    def make(rate):
        return load_trace(trace, length_scale=length_scale, output_scale=output_scale,
                          rate=rate, arrivals=arrivals, cv=cv, num_requests=n_at(rate),
                          seed=seed, skip=skip)
    return make


def compare(model: ModelSpec, deployments: dict[str, Deployment], make, *,
            rate: float | None = None, cfg: SimConfig | None = None,
            rate_range: tuple[float, float] = (0.25, 8.0), iters: int = 8,
            progress: Callable[[str], None] | None = None) -> dict:
    """Metrics per deployment: at ``rate``, or at its capacity when ``rate`` is None.

    Returns ``{"deployments": {name: metrics}, "ratios": {...}}``; ratios compare
    ``throughput_tok_s`` of prfaas against the others when present.
    """
    cfg = cfg or SimConfig()
    out = {}
    for name, dep in deployments.items():
        if progress:
            progress(name)
        if rate is None:
            cap, m = capacity(model, dep, cfg, make, *rate_range, iters=iters)
            m["capacity_req_s"] = cap
        else:
            m = simulate_one(model, dep, cfg, make(rate))
            m["rate_req_s"] = rate
        out[name] = m
    # At capacity the workloads differ only in rate, so the capacity ratio is the
    # throughput ratio (tok/s over a finite run also counts the drain at the end).
    key = "throughput_tok_s" if rate is not None else "capacity_req_s"
    ratios = {}
    if "prfaas" in out:
        for other in ("homogeneous", "naive"):
            if other in out and out[other][key] > 0:
                ratios[f"prfaas_vs_{other}"] = out["prfaas"][key] / out[other][key]
    return {"deployments": out, "ratios": ratios}


def with_rate_range(model: ModelSpec, deps: dict[str, Deployment]) -> tuple[float, float]:
    """A bisection range that brackets every deployment's capacity (from a fluid bound)."""
    from hyla.disagg.sim.hardware import step_time

    best = 0.0
    for dep in deps.values():
        profs = [(dep.local, dep.local_prefill)] + ([(dep.remote, dep.remote_instances)]
                                                    if dep.remote else [])
        tok_s = sum(n * 8192 / step_time(p, model, [(0, 8192)], 0) for p, n in profs)
        best = max(best, tok_s)
    return 0.05, max(1.0, best / 2_000)


def scaled(dep: Deployment, **kw) -> Deployment:
    return dataclasses.replace(dep, **kw)
