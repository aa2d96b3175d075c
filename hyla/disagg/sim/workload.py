"""Workloads for the simulator: request traces (CSV) and the published setup's synthetic mix.

A :class:`Request` has an arrival time, a prompt length, an output length and, for a
follow-up turn of a conversation, its session and the length of the prefix it shares with
the session's previous turn (what a prefix cache can serve).

Traces: the built-in ones by name (``azure-conv``, ``arxiv-summarization``: package data, see
:mod:`hyla.disagg.sim.traces`) or any CSV by path (columns ``num_prefill_tokens``,
``num_decode_tokens`` and, when present, ``arrived_at``). ``length_scale`` multiplies prompt
lengths (and ``output_scale`` output lengths): the traces are short-context, and long-context
studies must say they scaled them. Arrivals: ``"trace"`` keeps the trace's own timestamps,
rescaled to ``rate`` requests/s on average (burstiness kept); ``"poisson"`` and ``"gamma"``
(coefficient of variation ``cv``, > 1 is burstier than Poisson) draw new ones.
"""

from __future__ import annotations

import csv
import math
import pathlib
import random
from dataclasses import dataclass
from statistics import NormalDist

from hyla.disagg.sim.traces import trace_path

ARRIVALS = ("trace", "poisson", "gamma")


@dataclass
class Request:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    session: int = -1        # -1: a fresh request
    prefix_len: int = 0      # tokens shared with the session's previous turn


def arrival_times(n: int, rate: float, process: str = "poisson", cv: float = 2.0,
                  seed: int = 0) -> list[float]:
    """``n`` arrival times at ``rate`` requests/s on average, starting at 0.

    Example:
        >>> ts = arrival_times(1000, 10.0, seed=1)
        >>> ts[0], round(len(ts) / ts[-1])
        (0.0, 10)
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if process not in ("poisson", "gamma"):
        raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    shape = 1.0 / (cv * cv)
    for _ in range(n):
        out.append(t)
        if process == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(shape, 1.0 / (shape * rate))
    return out


def load_trace(path: str | pathlib.Path, *, length_scale: float = 1.0,
               output_scale: float = 1.0, rate: float | None = None, arrivals: str = "trace",
               cv: float = 2.0, num_requests: int | None = None, skip: int = 0,
               max_len: int = 1 << 20, seed: int = 0) -> list[Request]:
    """Requests from a trace: a built-in name or a CSV path (see the module docstring).

    With ``arrivals="trace"`` and no ``arrived_at`` column, Poisson arrivals are used.
    ``rate=None`` keeps the trace's own rate (trace arrivals only).

    Example:
        >>> reqs = load_trace("azure-conv", num_requests=3)
        >>> [(r.prompt_len, r.output_len) for r in reqs]
        [(374, 44), (396, 109), (879, 55)]
    """
    path = trace_path(path)
    if length_scale <= 0 or output_scale <= 0:
        raise ValueError("length_scale and output_scale must be > 0")
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "num_prefill_tokens" not in rows[0] or "num_decode_tokens" not in rows[0]:
        raise ValueError(f"trace {path} needs num_prefill_tokens and num_decode_tokens columns")
    rows = rows[skip:]
    if num_requests is not None:
        rows = rows[:num_requests]
    if not rows:
        raise ValueError(f"trace {path}: no requests left after skip={skip}")
    has_t = "arrived_at" in rows[0]
    if arrivals == "trace" and has_t:
        t0 = float(rows[0]["arrived_at"])
        ts = [float(r["arrived_at"]) - t0 for r in rows]
        if rate is not None and ts[-1] > 0:
            k = (len(ts) - 1) / ts[-1] / rate
            ts = [t * k for t in ts]
    else:
        if rate is None:
            raise ValueError(f"trace {path} has no arrival times: give a rate")
        ts = arrival_times(len(rows), rate, "poisson" if arrivals == "trace" else arrivals,
                           cv, seed)
    return [Request(i, t, min(max_len, max(1, round(int(r["num_prefill_tokens"]) * length_scale))),
                    max(1, round(int(r["num_decode_tokens"]) * output_scale)))
            for i, (t, r) in enumerate(zip(ts, rows, strict=True))]


@dataclass(kw_only=True)
class SyntheticMix:
    """The published setup's workload, an assumption (the paper's trace is not public).

    Long-context, prefill-heavy traffic with multi-turn reuse: a fresh request has a
    log-normal prompt (median ``prompt_median`` tokens); with probability ``followup`` a
    request continues an earlier session instead, its prompt being that session's last
    context (prompt + output) plus a log-normal new turn (median ``turn_median``), so a
    prefix cache can serve the shared part. Outputs are log-normal (median
    ``output_median``). The medians are chosen so that about half of the requests exceed the
    published optimum threshold of 19.4K incremental tokens, as the paper reports.

    ``stratify``: lengths and the follow-up choice are drawn stratified in blocks of this
    many requests (see :class:`_Deviates`; 1: independent draws), so that seeds differ in
    order and arrivals far more than in how much work they hold.
    """

    prompt_median: int = 28_000
    prompt_sigma: float = 0.8
    turn_median: int = 1_500
    turn_sigma: float = 1.0
    followup: float = 0.25
    output_median: int = 600
    output_sigma: float = 0.8
    max_len: int = 131_072
    stratify: int = 100

    def generate(self, n: int, rate: float, arrivals: str = "poisson", cv: float = 2.0,
                 seed: int = 0) -> list[Request]:
        rng = random.Random(seed + 7919)
        ts = arrival_times(n, rate, arrivals, cv, seed)
        out: list[Request] = []
        sessions: list[tuple[int, int]] = []   # (session id, context after its last turn)
        draws = _Deviates(rng, self.stratify)

        def logn(kind, median, sigma, lo, hi):
            return int(min(hi, max(lo, median * math.exp(sigma * draws.normal(kind)))))
        for i, t in enumerate(ts):
            olen = logn("output", self.output_median, self.output_sigma, 8, 16_384)
            if sessions and draws.uniform("followup") < self.followup:
                j = rng.randrange(len(sessions))
                sid, ctx = sessions[j]
                plen = ctx + logn("turn", self.turn_median, self.turn_sigma, 16, 32_768)
                if plen <= self.max_len:
                    out.append(Request(i, t, plen, olen, sid, ctx))
                    sessions[j] = (sid, plen + olen)
                    continue
            plen = logn("prompt", self.prompt_median, self.prompt_sigma, 128, self.max_len)
            out.append(Request(i, t, plen, olen, i, 0))
            sessions.append((i, plen + olen))
        return out


class _Deviates:
    """Uniform and normal deviates, one stream per kind, stratified in blocks of ``block``
    draws (each block holds one draw from each of ``block`` equal-probability strata, in a
    random order; 0 or 1: plain independent draws).

    Stratification is a variance reduction: a block's lengths follow the distribution's
    quantiles instead of clustering by chance, so the workload's total prefill work (what
    a capacity is most sensitive to) varies far less from seed to seed, and capacities and
    their ratios need fewer requests for the same interval. Blocks are fixed-size, so the
    first ``k`` blocks are the same however many requests are drawn (common random numbers
    across rates hold).
    """

    _NORMAL = NormalDist()

    def __init__(self, rng: random.Random, block: int):
        self.rng, self.block = rng, max(1, block)
        self.pending: dict[str, list[float]] = {}

    def uniform(self, kind: str) -> float:
        if self.block == 1:
            return self.rng.random()
        q = self.pending.get(kind)
        if not q:
            q = [(i + self.rng.random()) / self.block for i in range(self.block)]
            self.rng.shuffle(q)
            self.pending[kind] = q
        return q.pop()

    def normal(self, kind: str) -> float:
        if self.block == 1:
            return self.rng.gauss(0, 1)
        return self._NORMAL.inv_cdf(min(max(self.uniform(kind), 1e-12), 1 - 1e-12))


def describe(requests: list[Request]) -> dict:
    """Length percentiles and rate of a workload, for reports."""
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]
    p = [r.prompt_len for r in requests]
    inc = [r.prompt_len - r.prefix_len for r in requests]
    o = [r.output_len for r in requests]
    span = requests[-1].arrival - requests[0].arrival
    return {"requests": len(requests), "rate_req_s": (len(requests) - 1) / span if span else None,
            "prompt_p50": pct(p, 0.5), "prompt_p90": pct(p, 0.9),
            "incremental_p50": pct(inc, 0.5), "output_p50": pct(o, 0.5),
            "output_p90": pct(o, 0.9), "followup_frac": sum(r.prefix_len > 0 for r in requests)
            / len(requests)}
