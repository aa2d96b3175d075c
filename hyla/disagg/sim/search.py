"""Capacity under SLOs as a number, and the routing policy's long-timescale search.

**Capacity of a configuration** (one seed): the highest arrival rate at which at least
``attainment`` (90%) of the requests meet both SLOs. Every rate runs the *same* requests
(lengths and arrival pattern from the seed, arrival times scaled by the rate: common random
numbers), so runs at different rates, and of different deployments, differ only in what is
compared. Rates lie on one geometric grid, ``(1 + rel_tol) ** k``: the search brackets the
capacity (steps of about ``growth`` from ``start``) and bisects on the grid until the
highest rate passed and the lowest missed are neighbours. It is deterministic (repeatable),
does not depend on where it started, and assumes attainment falls with the rate
(monotone). A run stops as soon as its verdict is certain
(:meth:`hyla.disagg.sim.model.Sim.run`, ``stop_below``).

**Tournament** (:func:`tournament`): the capacity of the best of several configurations,
the same bisection where a rate passes when *any* alive configuration meets the SLOs there.
When some pass, those that fail are dropped (they cannot pass at the higher rates tried
next); when none passes, the ``keep`` closest to passing stay, and ``pinned`` ones always.
The result is the capacity of the configuration a long-timescale search picks by measured
goodput at that load, and never below that of a pinned one on the same seed.

**The policy's space** (:func:`prfaas_space`): thresholds ``t = 0`` (every uncached prefill
remote, the local instances all decode: naive heterogeneous' routing), ``t = ALL_LOCAL``
(nothing offloaded) with every P/D split, and the thresholds that offload given fractions
of the workload's requests (quantiles of its prompt lengths) with every split.

**Over seeds** (:func:`interval`): mean and 95% interval (Student t) of per-seed values;
ratios between deployments are taken per seed (same arrivals) and then summarised.
The error of one run's attainment estimate is about ``sqrt(p (1 - p) / n)`` for ``n``
requests (:func:`attainment_error`; 0.015 for 400 at 90%), an underestimate since requests
queue together; the spread over seeds is what the intervals report.

Example:
    >>> def ok(rate):                       # a configuration whose capacity is 3.0 req/s
    ...     return {"slo_attainment": 1.0 if rate <= 3.0 else 0.5}
    >>> res = tournament({"a": ok}, start=1.0, rel_tol=0.01)
    >>> round(res["capacity"], 2), res["choice"]
    (2.99, 'a')
    >>> interval([1.0, 1.1, 0.9])["half"] < 0.25
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from hyla.disagg.policy import ALL_LOCAL
from hyla.disagg.sim.model import Deployment, Sim, SimConfig
from hyla.disagg.sim.workload import Request

# two-sided 95% Student t quantiles by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def interval(xs: list[float]) -> dict:
    """Mean and 95% interval (Student t over ``len(xs)`` values; one value: no interval,
    ``half`` None).

    Returns ``{"mean", "half", "lo", "hi", "rel_half", "n", "values"}``; ``rel_half`` is
    the half-width over the mean.
    """
    n = len(xs)
    if n == 0:
        raise ValueError("interval of no values")
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "half": None, "lo": None, "hi": None, "rel_half": None,
                "n": 1, "values": list(xs)}
    else:
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        df = n - 1
        t = _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]
        half = t * sd / math.sqrt(n)
    return {"mean": mean, "half": half, "lo": mean - half, "hi": mean + half,
            "rel_half": half / mean if mean else float("nan"), "n": n, "values": list(xs)}


def attainment_error(n: int, p: float = 0.9) -> float:
    """Standard error of an SLO attainment ``p`` estimated from ``n`` independent requests."""
    return math.sqrt(p * (1 - p) / n)


@dataclass(frozen=True)
class Choice:
    """One point of a deployment's configuration space: ``threshold`` (None: the
    deployment has none) and ``local_prefill`` instances (None: as configured)."""

    threshold: int | None = None
    local_prefill: int | None = None

    def label(self) -> str:
        parts = []
        if self.threshold is not None:
            parts.append("t=0 (all remote)" if self.threshold == 0 else
                         "t=inf (all local)" if self.threshold >= ALL_LOCAL else
                         f"t={self.threshold:,}")
        if self.local_prefill is not None:
            parts.append(f"{self.local_prefill} prefill")
        return ", ".join(parts) or "as configured"

    @property
    def family(self) -> str:
        """"all remote", "all local", "threshold" or "split" (no threshold)."""
        if self.threshold is None:
            return "split"
        return "all remote" if self.threshold == 0 else \
            "all local" if self.threshold >= ALL_LOCAL else "threshold"


def apply(dep: Deployment, c: Choice) -> Deployment:
    """``dep`` with the choice's threshold (the controller's anchor) and split."""
    kw = {}
    if c.local_prefill is not None:
        kw["local_prefill"] = c.local_prefill
    if c.threshold is not None:
        kw["policy"] = dataclasses.replace(dep.policy, threshold=c.threshold,
                                           t_max=max(dep.policy.t_max, c.threshold))
    return dataclasses.replace(dep, **kw)


def offload_thresholds(requests: list[Request], fractions=(0.1, 0.25, 0.5, 0.75)) -> list[int]:
    """Thresholds that offload about ``fractions`` of ``requests`` (by incremental prompt
    length, the prompt minus its reusable prefix), rounded to 2 significant digits.

    Example:
        >>> reqs = [Request(i, 0.0, 1000 * (i + 1), 10) for i in range(10)]
        >>> offload_thresholds(reqs, (0.1, 0.5))
        [9000, 5000]
    """
    inc = sorted(r.prompt_len - r.prefix_len for r in requests)
    out = []
    for f in fractions:
        x = inc[min(len(inc) - 1, max(0, math.ceil((1 - f) * len(inc)) - 1))]
        x = max(1, int(float(f"{x:.2g}")))
        if x not in out:
            out.append(x)
    return out


def prfaas_space(dep: Deployment, requests: list[Request], *,
                 fractions=(0.1, 0.25, 0.5, 0.75), splits: list[int] | None = None
                 ) -> list[Choice]:
    """The PrfaaS policy's long-timescale space on this workload: ``t = 0`` with no local
    prefill instance (every local instance decodes), ``t = ALL_LOCAL`` and the
    :func:`offload_thresholds` of ``fractions``, each with every split in ``splits``
    (default: 1 .. local instances - 1)."""
    splits = splits or list(range(1, dep.local_instances))
    out = [Choice(0, 0)]
    for t in [ALL_LOCAL, *offload_thresholds(requests, fractions)]:
        out += [Choice(t, n) for n in splits]
    return out


def split_space(dep: Deployment, splits: list[int] | None = None) -> list[Choice]:
    """Every P/D split of a homogeneous deployment (default: 1 .. instances - 1)."""
    return [Choice(None, n) for n in splits or range(1, dep.local_instances)]


def run_at(model, dep: Deployment, cfg: SimConfig, requests: list[Request],
           attainment: float | None = 0.9) -> dict:
    """One run; ``attainment``: stop once it is certain to end below it."""
    return Sim(model, dep, cfg).run(requests, stop_below=attainment)


def tournament(configs: dict[Hashable, Callable[[float], dict]], *, start: float,
               attainment: float = 0.9, rel_tol: float = 0.02, growth: float = 1.5,
               keep: int = 4, pinned: tuple = (), min_rate: float = 1e-3,
               max_rate: float = 1e4) -> dict:
    """Capacity of the best of ``configs`` (name -> ``run(rate) -> metrics``; see the
    module docstring). Returns ``{"capacity", "choice", "metrics", "passed", "failed",
    "runs", "steps"}``: ``passed``/``failed`` the highest rate each configuration met the
    SLOs at and the lowest it missed them at (bounds on its own capacity); ``capacity`` 0.0
    when nothing passes down to ``min_rate``, and the last rate tried when everything passes
    up to ``max_rate`` (a run too short to load the system: give it more requests).
    """
    if start <= 0 or growth <= 1 or rel_tol <= 0:
        raise ValueError(f"need start > 0, growth > 1, rel_tol > 0; got {start}, {growth}, "
                         f"{rel_tol}")
    # Rates live on one geometric grid, (1 + rel_tol) ** k, whatever the start: the result
    # is the highest grid rate passed, so two searches of one configuration from different
    # starts agree (a deployment and the same one inside a larger space give one figure).
    step = math.log1p(rel_tol)
    jump = max(1, round(math.log(growth) / step))
    k = round(math.log(start) / step)
    k_min, k_max = math.floor(math.log(min_rate) / step), math.ceil(math.log(max_rate) / step)
    alive = list(configs)
    klo, khi, best, best_m = None, None, None, None
    passed: dict = {}
    failed: dict = {}
    steps, runs = [], 0
    while True:
        rate = math.exp(k * step)
        res = {c: configs[c](rate) for c in alive}
        runs += len(alive)
        ok = [c for c in alive if res[c]["slo_attainment"] >= attainment]
        steps.append({"rate": rate, "alive": len(alive), "passed": len(ok)})
        if ok:
            klo = k
            best = max(ok, key=lambda c: (res[c]["slo_attainment"],
                                          -(res[c].get("ttft_p90_s") or 0.0)))
            best_m = res[best]
            for c in ok:
                passed[c] = rate
            for c in alive:
                if c not in ok:
                    failed[c] = min(failed.get(c, math.inf), rate)
            alive = ok
        else:
            khi = k
            for c in alive:
                failed[c] = min(failed.get(c, math.inf), rate)
            if len(alive) > keep:
                ranked = sorted(alive, key=lambda c: -res[c]["slo_attainment"])
                alive = [c for c in alive if c in ranked[:keep] or c in pinned]
        if khi is None:
            k += jump
            if k > k_max:
                break
        elif klo is None:
            k -= jump
            if k < k_min:
                break
        elif khi - klo <= 1:
            break
        else:
            k = (klo + khi) // 2
    lo = 0.0 if klo is None else math.exp(klo * step)
    return {"capacity": lo, "choice": best, "metrics": best_m, "passed": passed,
            "failed": failed, "runs": runs, "steps": steps}


def deployment_tournament(model, cfg: SimConfig, dep: Deployment, choices: list[Choice],
                          make: Callable[[float], list[Request]], *, start: float,
                          attainment: float = 0.9, rel_tol: float = 0.02, keep: int = 4,
                          pinned: tuple = ()) -> dict:
    """:func:`tournament` over ``choices`` applied to ``dep`` (``make(rate)``: the
    requests at that rate)."""
    cache: dict[float, list[Request]] = {}

    def reqs(rate):
        if rate not in cache:
            cache.clear()
            cache[rate] = make(rate)
        return cache[rate]

    def runner(d):
        return lambda rate: run_at(model, d, cfg, reqs(rate), attainment)
    configs = {c: runner(apply(dep, c)) for c in choices}
    return tournament(configs, start=start, attainment=attainment, rel_tol=rel_tol,
                      keep=keep, pinned=pinned)
