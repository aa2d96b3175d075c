"""Capacities of the three deployments over several seeds, with the PrfaaS policy's
long-timescale search, 95% intervals and per-seed ratios (:func:`compare_capacity`).

Per seed (one workload draw: request lengths and arrival pattern), all on the same requests:

- ``naive``: the capacity of naive heterogeneous (no parameter);
- ``homogeneous``: the best P/D split's capacity (a :func:`~hyla.disagg.sim.search.tournament`
  over every split), so PrfaaS is compared with the baseline at its best;
- ``prfaas``: the best of the policy's whole space (:func:`~hyla.disagg.sim.search.prfaas_space`),
  searched as three families whose capacities are reported side by side: ``all remote``
  (t = 0), ``all local`` (t = infinity, best split) and ``threshold`` (the best of the
  offload thresholds with every split). The policy's capacity is the best family's, its
  choice that family's configuration; the short-timescale controller runs in every run
  (within its band around the chosen t). ``configured``: the deployment as given, for
  reference (the threshold and split it was built with).

Example (small deployments, few requests: the shape of the result, not a figure):
    >>> from hyla.disagg.sim.hardware import published_1t_hybrid, InstanceProfile
    >>> from hyla.disagg.sim.model import Deployment
    >>> from hyla.disagg.sim.workload import SyntheticMix
    >>> h20, h200 = InstanceProfile(gpu="H20"), InstanceProfile(gpu="H200")
    >>> deps = {"homogeneous": Deployment(name="h", kind="homogeneous", local=h20,
    ...                                   local_instances=3, local_prefill=2),
    ...         "naive": Deployment(name="n", kind="naive", local=h20, local_instances=2,
    ...                             local_prefill=0, remote=h200, remote_instances=1),
    ...         "prfaas": Deployment(name="p", kind="prfaas", local=h20, local_instances=2,
    ...                              local_prefill=1, remote=h200, remote_instances=1)}
    >>> from hyla.disagg.sim.setups import workload_maker
    >>> mix = SyntheticMix(prompt_median=4000, followup=0.0, output_median=8)
    >>> res = compare_capacity(published_1t_hybrid(), deps, lambda seed: workload_maker(
    ...     mix=mix, num_requests=20, min_duration_s=10, seed=seed), seeds=[0], rel_tol=0.1,
    ...     fractions=(0.5,))
    >>> res["deployments"]["prfaas"]["capacity"]["mean"] >= \\
    ...     res["deployments"]["naive"]["capacity"]["mean"]
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hyla.disagg.sim.hardware import step_time
from hyla.disagg.sim.model import Deployment, SimConfig
from hyla.disagg.sim.search import (
    Choice,
    deployment_tournament,
    interval,
    prfaas_space,
    split_space,
)
from hyla.disagg.sim.workload import Request

FAMILIES = ("all remote", "all local", "threshold")
_KEEP = ("ttft_p50_s", "ttft_p90_s", "tpot_p90_s", "throughput_tok_s", "goodput_req_s",
         "slo_attainment", "egress_gbps", "link_utilisation", "offload_fraction",
         "threshold_initial", "threshold_final", "requests")


def fluid_bound(model, dep: Deployment, requests: list[Request], link_gbps: float) -> float:
    """An upper bound on a deployment's rate from its prefill and link work alone
    (requests/s): where its capacity searches start."""
    def prefill_s(prof, r):
        return step_time(prof, model, [(0, max(1, r.prompt_len - r.prefix_len))], 0)
    n = len(requests)
    if dep.kind == "homogeneous" or dep.remote is None:
        work = sum(prefill_s(dep.local, r) for r in requests) / n
        return max(1, dep.local_prefill) / work
    remote = sum(prefill_s(dep.remote, r) for r in requests) / n / dep.remote_instances
    link = sum(model.transfer_bytes(r.prompt_len) for r in requests) / n * 8 / (link_gbps * 1e9)
    bound = 1.0 / max(remote, link)
    if dep.kind == "prfaas":   # the local prefill instances add to it
        bound += (dep.local_instances - 1) / (sum(prefill_s(dep.local, r) for r in requests) / n)
    return bound


def _slim(res: dict, choice_of=lambda c: c) -> dict:
    m = res["metrics"] or {}
    c = res["choice"]
    return {"capacity": res["capacity"], "choice": choice_of(c) if c is not None else None,
            "runs": res["runs"], "metrics": {k: m.get(k) for k in _KEEP}}


def compare_capacity(model, deps: dict[str, Deployment],
                     make_seed: Callable[[int], Callable[[float], list[Request]]],
                     seeds: list[int], cfg: SimConfig | None = None, *,
                     search: bool = True, fractions=(0.1, 0.25, 0.5, 0.75),
                     rel_tol: float = 0.02, keep: int = 4, configured: bool = True,
                     screen_seed: Callable[[int], Callable[[float], list[Request]]] | None
                     = None, finalists: int = 3,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Per-seed capacities of ``deps`` (names ``homogeneous``, ``naive``, ``prfaas``; any
    subset), their 95% intervals, and per-seed ratios of PrfaaS to each baseline and to the
    better of the two. ``search=False`` takes every deployment as configured (no split or
    threshold search). ``make_seed(seed)(rate)``: the workload of that seed at that rate.

    ``screen_seed``: a cheaper workload of the same seed (fewer requests; the same first
    ones). A search over several configurations then runs twice: on the screen workload
    over all of them, and on ``make_seed``'s over the ``finalists`` that went furthest in
    the first (every family keeps its own finalists, so t = 0 and t = inf always reach the
    second). The capacities reported are the second's.

    Returns ``{"seeds", "deployments": {name: {"capacity": interval, "per_seed": [...],
    "alternatives": {family: interval}, "choice": [labels]}}, "ratios": {name: interval}}``.
    """
    cfg = cfg or SimConfig()
    say = progress or (lambda s: None)
    per_seed: dict[str, list[dict]] = {n: [] for n in deps}
    alts: dict[str, list[dict]] = {}
    prev: dict[str, float] = {}
    kw = dict(rel_tol=rel_tol, keep=keep)
    for seed in seeds:
        make = make_seed(seed)
        probe = make(1.0)
        screen = screen_seed(seed) if screen_seed is not None else None

        def tournament(dep, cands, start, make=make, screen=screen):
            if screen is not None and len(cands) > 1:
                coarse = deployment_tournament(model, cfg, dep, cands, screen, start=start,
                                               rel_tol=max(rel_tol, 0.05), keep=keep)
                # furthest first: highest rate passed, then lowest rate missed
                passed, failed = coarse["passed"], coarse["failed"]
                cands = sorted(cands, key=lambda x: (-passed.get(x, 0.0),
                                                     -failed.get(x, math.inf)))[:finalists]
                start = coarse["capacity"] or start
            return deployment_tournament(model, cfg, dep, cands, make, start=start, **kw)

        def start(name, dep, default=None, probe=probe):
            if name in prev:
                return prev[name]
            return default or 0.8 * fluid_bound(model, dep, probe, cfg.link_gbps)
        row: dict[str, dict] = {}
        if "naive" in deps:
            d = deps["naive"]
            row["naive"] = _slim(deployment_tournament(model, cfg, d, [Choice()], make,
                                                       start=start("naive", d), **kw),
                                 lambda c: "as configured")
            say(f"seed {seed}: naive {row['naive']['capacity']:.3f} req/s")
        if "homogeneous" in deps:
            d = deps["homogeneous"]
            space = split_space(d) if search else [Choice()]
            row["homogeneous"] = _slim(tournament(d, space, start("homogeneous", d)),
                                       lambda c: c.label())
            say(f"seed {seed}: homogeneous {row['homogeneous']['capacity']:.3f} req/s "
                f"({row['homogeneous']['choice']})")
        if "prfaas" in deps:
            d = deps["prfaas"]
            base = row.get("naive", {}).get("capacity") or None
            fam: dict[str, dict] = {}
            if search:
                space = prfaas_space(d, probe, fractions=fractions)
                for f in FAMILIES:
                    cands = [c for c in space if c.family == f]
                    s0 = prev.get(f"prfaas/{f}") or (base if f != "all local" else None) \
                        or start("prfaas", d)
                    fam[f] = _slim(tournament(d, cands, s0), lambda c: c.label())
                    prev[f"prfaas/{f}"] = fam[f]["capacity"] or s0
                    say(f"seed {seed}: prfaas {f} {fam[f]['capacity']:.3f} req/s "
                        f"({fam[f]['choice']})")
            if configured or not search:
                fam["configured"] = _slim(deployment_tournament(
                    model, cfg, d, [Choice()], make, start=start("prfaas", d, base), **kw),
                    lambda c, d=d: f"t={d.policy.threshold:,}, {d.local_prefill} prefill")
                say(f"seed {seed}: prfaas as configured {fam['configured']['capacity']:.3f}")
            pick = max((f for f in fam if search is False or f != "configured"),
                       key=lambda f: fam[f]["capacity"])
            row["prfaas"] = {**fam[pick], "family": pick}
            alts.setdefault("prfaas", []).append(fam)
        for name, r in row.items():
            per_seed[name].append({"seed": seed, **r})
            if r["capacity"]:
                prev[name] = r["capacity"]
    out = {}
    for name, rows in per_seed.items():
        caps = [r["capacity"] for r in rows]
        entry = {"capacity": interval(caps), "per_seed": rows,
                 "choice": [r["choice"] for r in rows]}
        if name in alts:
            entry["alternatives"] = {f: interval([a[f]["capacity"] for a in alts[name]])
                                     for f in alts[name][0]}
            entry["alternative_choices"] = {f: [a[f]["choice"] for a in alts[name]]
                                            for f in alts[name][0]}
        out[name] = entry
    ratios = {}
    if "prfaas" in per_seed:
        p = [r["capacity"] for r in per_seed["prfaas"]]
        others = [n for n in ("homogeneous", "naive") if n in per_seed]
        for o in others:
            b = [r["capacity"] for r in per_seed[o]]
            if all(b):
                ratios[f"prfaas_vs_{o}"] = interval([x / y for x, y in zip(p, b, strict=True)])
        if len(others) == 2:
            best = [max(per_seed["homogeneous"][i]["capacity"], per_seed["naive"][i]["capacity"])
                    for i in range(len(seeds))]
            if all(best):
                ratios["prfaas_vs_best_baseline"] = interval(
                    [x / y for x, y in zip(p, best, strict=True)])
    return {"seeds": list(seeds), "deployments": out, "ratios": ratios,
            "rel_tol": rel_tol, "fractions": list(fractions)}


def with_remote_mfu(dep: Deployment, mfu: float) -> Deployment:
    """``dep`` with its remote prefill cluster at ``mfu`` (a deployment without one as is)."""
    if dep.remote is None:
        return dep
    return dataclasses.replace(dep, remote=dataclasses.replace(dep.remote, mfu=mfu))


def fit_remote_mfu(model, deps: dict[str, Deployment],
                   make_seed: Callable[[int], Callable[[float], list[Request]]],
                   seeds: list[int], cfg: SimConfig | None = None, *, target: float,
                   lo: float = 0.05, hi: float = 0.45, iters: int = 6, rel_tol: float = 0.02,
                   screen_seed=None, progress: Callable[[str], None] | None = None) -> dict:
    """The remote (H200) prefill MFU at which naive heterogeneous serves ``target`` times
    the capacity of homogeneous PD at its best split, as the mean of per-seed ratios on
    ``seeds`` (bisection on ``[lo, hi]``: naive's capacity grows with the MFU;
    ``screen_seed`` as in :func:`compare_capacity`).

    One published ratio fixes one unknown; every other ratio is then a prediction.
    Returns ``{"remote_mfu", "ratio": interval, "target", "homogeneous": interval,
    "steps": [{"remote_mfu", "ratio"}]}``; ``remote_mfu`` is the step whose mean ratio came
    closest to ``target``.
    """
    if not 0 < lo < hi <= 1 or target <= 0 or iters < 1:
        raise ValueError(f"need 0 < lo < hi <= 1, target > 0, iters >= 1; got {lo}, {hi}, "
                         f"{target}, {iters}")
    say = progress or (lambda s: None)
    homo = compare_capacity(model, {"homogeneous": deps["homogeneous"]}, make_seed, seeds, cfg,
                            rel_tol=rel_tol, screen_seed=screen_seed)
    homo = homo["deployments"]["homogeneous"]
    base = homo["capacity"]["values"]
    if not all(base):
        raise ValueError(f"homogeneous PD meets the SLOs at no rate on some seed ({base}): "
                         "nothing to fit a ratio to")
    steps = []
    for _ in range(iters):
        mid = (lo + hi) / 2
        naive = compare_capacity(model, {"naive": with_remote_mfu(deps["naive"], mid)},
                                 make_seed, seeds, cfg, rel_tol=rel_tol)
        caps = naive["deployments"]["naive"]["capacity"]["values"]
        ratio = interval([c / b for c, b in zip(caps, base, strict=True)])
        steps.append({"remote_mfu": mid, "ratio": ratio})
        say(f"remote MFU {mid:.3f}: naive / homogeneous {ratio['mean']:.3f}")
        if ratio["mean"] > target:
            hi = mid
        else:
            lo = mid
    best = min(steps, key=lambda r: abs(r["ratio"]["mean"] - target))
    return {"remote_mfu": best["remote_mfu"], "ratio": best["ratio"], "target": target,
            "homogeneous": homo["capacity"], "steps": steps}
