"""Prefill-as-a-Service routing policy: where a request's prefill runs and which worker
gets it. Pure Python, no torch.

The same object (built by :func:`build_policy` from one :class:`RouterConfig`) runs inside
the simulator (:mod:`hyla.disagg.sim.model`) and in the live router process
(:mod:`hyla.disagg.live.router`), which feeds it measured values instead of simulated ones.
It implements :class:`hyla.disagg.policy.base.RoutingPolicy`.

Policy (after the published PrfaaS design):

- **Incremental-length threshold.** A request's incremental prefill is its prompt minus the
  prefix already cached where it would run. If that exceeds the threshold ``t`` it goes to
  the remote prefill cluster (compute-dense accelerators, state shipped back over the
  inter-cluster link); otherwise it stays in the local prefill/decode cluster.
- **Cache-aware placement.** When the link has headroom (utilisation below
  ``cfg.util_low``) the best prefix cache anywhere counts: the request is placed in the
  cluster holding the longest prefix, and if the other cluster must run it the cached
  prefix is moved (``RouteDecision.cache_transfer``). When the link is busy, placement is
  cache-affine: each cluster counts only its own cache, and nothing extra crosses the link.
- **Short timescale** (:meth:`PrfaasRouter.observe`, every few seconds): egress-link
  utilisation and the remote and local prefill queues move ``t`` around its long-timescale
  value (``cfg.threshold``, the *anchor*). A busy link or a remote queue longer than the
  local one raises ``t`` (offload less); an idle link and a local queue longer than the
  remote one lower it (offload more); with neither signal ``t`` steps back to the anchor.
  Multiplicative steps, never more than a factor ``cfg.band`` from the anchor (and within
  ``[t_min, t_max]``), so the controller answers transients but cannot carry the policy
  away from the long-timescale choice: once the signal clears, ``t`` is back at the anchor
  within ``cfg.reaction_steps`` observations (its reaction time). The anchors ``t = 0``
  (every uncached prefill remote) and ``t = ALL_LOCAL`` (none) are fixed points.
- **Long timescale**: the anchor and the local P/D split are chosen by measured goodput
  under the SLOs over the whole space, ``t = 0`` and ``t = ALL_LOCAL`` included (the
  simulator's :mod:`hyla.disagg.sim.search`; live, the operator applies its choice);
  :func:`recommend_pd_split` gives the split the measured busy fractions suggest.
- **Fallback.** While the remote pool is down, or its queue exceeds
  ``cfg.max_remote_queue_s``, every request stays local.
- **The measured link** (:meth:`PrfaasRouter.check_link`, live): a request the threshold
  sends remote is shipped only if the expected transfer time of its state on the chosen
  path (:class:`~hyla.disagg.policy.link.LinkEstimate`: measured throughput and latency,
  what is already queued on it) is no longer than prefilling it locally (the local queue
  plus its own prefill), within ``cfg.queue_margin_s``; otherwise it stays local, but
  for a small share of probes that keep the estimate current. A path whose circuit
  breaker is open ships only its half-open probes.

API (what the live router calls)::

    router = build_policy(RouterConfig(threshold=19_400, link_gbps=100))
    d = router.route(prompt_len=30_000, cached={"local": 0, "remote": 8_192}, now=t)
    d.target                     # "local" or "remote"
    d.compute_tokens             # tokens the chosen cluster must prefill
    d.cache_transfer             # None, or ("local", "remote", n_tokens): prefix moved first
    w = router.pick(workers)     # which of them: least queued prefill, then fewest requests
    router.observe(now=t, egress_gbps=12.5, remote_queue_s=0.8, local_queue_s=2.0,
                   remote_up=True)   # returns the new threshold
    recommend_pd_split(n_local=8, n_prefill=2, prefill_busy=0.9, decode_busy=0.3)  # -> 3

Example:
    >>> r = PrfaasRouter(RouterConfig(threshold=1000))
    >>> r.route(500, {"local": 0, "remote": 0}).target
    'local'
    >>> r.route(5000, {"local": 0, "remote": 0}).target
    'remote'
    >>> r.route(5000, {"local": 4500, "remote": 0}).target   # cached locally: 500 new tokens
    'local'
    >>> PrfaasRouter(RouterConfig(threshold=0)).route(10).target   # t = 0: all remote
    'remote'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hyla.disagg.policy.base import LOCAL, REMOTE, C, RouteDecision, least_loaded
from hyla.disagg.policy.link import DOWN, LinkEstimate

#: ``threshold`` that keeps every prefill local (t = infinity); ``threshold=0`` sends every
#: uncached prefill to the remote cluster.
ALL_LOCAL = 1 << 40


@dataclass(kw_only=True)
class RouterConfig:
    """Knobs of :class:`PrfaasRouter` (all lengths in tokens, times in seconds): the one
    config type of the routing policy, held as-is by the live router
    (``LiveRouterConfig.policy``) and by a simulated deployment (``Deployment.policy``).

    ``threshold`` is the initial ``t``; ``t_min`` its floor (None: 256, or ``threshold`` if
    lower); ``link_gbps`` the egress link's capacity, used to turn measured Gbps into a
    utilisation (the simulator sets it to its simulated link's). ``adapt=False`` freezes
    ``t`` (a static threshold). ``threshold=0`` sends every uncached prefill remote,
    ``threshold=ALL_LOCAL`` none (``t_max`` is raised to it). ``band``: the short-timescale
    controller keeps ``t`` within a factor ``band`` of ``threshold``; ``reaction_steps``
    observations bring it back from the band's edge.

    Example:
        >>> c = RouterConfig(threshold=8000)
        >>> c.reaction_steps, RouterConfig(threshold=ALL_LOCAL).t_max == ALL_LOCAL
        (5, True)
    """

    threshold: int = 19_400          # the published optimum for its workload
    t_min: int | None = None
    t_max: int = 1 << 20
    link_gbps: float = 100.0
    util_high: float = 0.7           # above: the link is busy, offload less
    util_low: float = 0.4            # below: the link has headroom
    max_remote_queue_s: float = 30.0  # remote queue beyond this: fall back to local
    queue_slack: float = 1.5         # remote queue > slack * local queue -> offload less
    queue_margin_s: float = 1.0      # ... and by more than this (queues this close: balanced)
    step: float = 1.15               # multiplicative change of t per observation
    band: float = 2.0                # t stays within [threshold / band, threshold * band]
    adapt: bool = True

    def __post_init__(self) -> None:
        if self.threshold >= ALL_LOCAL:
            self.t_max = max(self.t_max, self.threshold)
        if self.band < 1:
            raise ValueError(f"band must be >= 1, got {self.band}")
        if not (0 <= self.t_floor <= self.threshold <= self.t_max
                and (self.t_floor > 0 or self.threshold == 0)):
            raise ValueError(f"need 0 < t_min <= threshold <= t_max, got {self.t_min}, "
                             f"{self.threshold}, {self.t_max}")
        if self.link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if not 0 <= self.util_low <= self.util_high:
            raise ValueError(f"need 0 <= util_low <= util_high, got {self.util_low}, "
                             f"{self.util_high}")
        if self.step <= 1:
            raise ValueError(f"step must be > 1, got {self.step}")
        if self.queue_margin_s < 0:
            raise ValueError(f"queue_margin_s must be >= 0, got {self.queue_margin_s}")

    @property
    def t_floor(self) -> int:
        """The effective ``t_min``."""
        return min(256, self.threshold) if self.t_min is None else self.t_min

    @property
    def reaction_steps(self) -> int:
        """Observations that bring ``t`` back from the band's edge to the anchor once the
        signals clear (times the observation interval: the controller's reaction time)."""
        return math.ceil(math.log(self.band) / math.log(self.step) - 1e-9) if self.band > 1 \
            else 0

    def bounds(self) -> tuple[float, float]:
        """``(lowest, highest)`` threshold the short-timescale controller may set."""
        return (max(self.t_floor, self.threshold / self.band),
                min(self.t_max, self.threshold * self.band))


@dataclass
class RouterStats:
    routed: dict = field(default_factory=lambda: {LOCAL: 0, REMOTE: 0})
    fallbacks: int = 0
    cache_transfers: int = 0
    threshold_history: list = field(default_factory=list)   # (now, t)


class PrfaasRouter:
    """Threshold router with short-timescale control of ``t`` (see the module docstring);
    a :class:`~hyla.disagg.policy.base.RoutingPolicy`."""

    def __init__(self, cfg: RouterConfig | None = None):
        self.cfg = cfg or RouterConfig()
        self.threshold = float(self.cfg.threshold)
        self.link_util = 0.0
        self.remote_queue_s = 0.0
        self.local_queue_s = 0.0
        self.remote_up = True
        self.stats = RouterStats()

    @property
    def t(self) -> int:
        return int(round(self.threshold))

    def remote_available(self) -> bool:
        return self.remote_up and self.remote_queue_s <= self.cfg.max_remote_queue_s

    def route(self, prompt_len: int, cached: dict[str, int] | None = None,
              now: float = 0.0) -> RouteDecision:
        """Decide local or remote for a prompt of ``prompt_len`` tokens.

        ``cached`` maps cluster ("local", "remote") to the longest cached prefix of this
        prompt there (missing = 0). ``now`` is only recorded.
        """
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
        cached = cached or {}
        c_loc = min(int(cached.get(LOCAL, 0)), prompt_len - 1)
        c_rem = min(int(cached.get(REMOTE, 0)), prompt_len - 1)
        if c_loc < 0 or c_rem < 0:
            raise ValueError(f"cached prefix lengths must be >= 0, got {cached}")
        t = self.t
        abundant = self.link_util < self.cfg.util_low
        if abundant:
            # Best global cache: the prefix may be moved to where the request runs.
            best = max(c_loc, c_rem)
            inc = prompt_len - best
            if inc <= t or not self.remote_available():
                move = (REMOTE, LOCAL, c_rem) if c_rem > c_loc else None
                d = self._decide(LOCAL, prompt_len, best, t, inc <= t, move)
            else:
                move = (LOCAL, REMOTE, c_loc) if c_loc > c_rem else None
                d = RouteDecision(REMOTE, inc, best, t, "long", move)
        else:
            # Cache-affine: each cluster counts only its own prefix cache.
            inc_loc = prompt_len - c_loc
            if inc_loc <= t or not self.remote_available():
                d = self._decide(LOCAL, prompt_len, c_loc, t, inc_loc <= t, None)
            else:
                d = RouteDecision(REMOTE, prompt_len - c_rem, c_rem, t, "long")
        self.stats.routed[d.target] += 1
        self.stats.fallbacks += d.reason == "fallback"
        self.stats.cache_transfers += d.cache_transfer is not None
        return d

    def pick(self, pool: Sequence[C], *, prefill: bool = True, prefer: str | None = None,
             turn: int = 0) -> C | None:
        """Which member of ``pool`` gets the request: :func:`least_loaded`."""
        return least_loaded(pool, prefill=prefill, prefer=prefer, turn=turn)

    def check_link(self, d: RouteDecision, link: LinkEstimate, *, state_bytes: int | None,
                   local_prefill_s: float, backlog_bytes: int = 0,
                   now: float = 0.0) -> RouteDecision:
        """The cost model on the measured link, for a request :meth:`route` sent remote:
        the same decision if shipping its state (behind ``backlog_bytes`` already queued
        on the path) is expected to take no longer than a local prefill
        (``local_prefill_s``: the local queue plus this prompt's own prefill) plus
        ``cfg.queue_margin_s``, else local. (The remote queue is the threshold
        controller's business, :meth:`observe`: this is about the link.) Local
        (``reason`` ``"link_slow"``, or ``"link_down"`` while the path's breaker is
        open), except for the probes that keep the estimate current
        (``reason`` ``"probe"``, counted in ``link.probes_in_flight`` until the router
        reports the transfer). ``state_bytes`` None (no transfer seen yet): the prior.

        Example:
            >>> from hyla.disagg.policy.link import LinkConfig
            >>> r = PrfaasRouter(RouterConfig(threshold=100, queue_margin_s=0.1))
            >>> link = LinkEstimate()
            >>> d = r.route(1000)
            >>> r.check_link(d, link, state_bytes=100_000, local_prefill_s=0.05).target
            'remote'
            >>> link.observe(100_000, seconds=0.25, wire_s=0.2)       # 4 Mbit/s
            >>> r.check_link(d, link, state_bytes=100_000, local_prefill_s=0.05).reason
            'link_slow'
        """
        if d.target != REMOTE:
            return d
        if link.state == DOWN:
            if link.allow_probe(now):
                link.start_probe(now)
                return RouteDecision(REMOTE, d.compute_tokens, d.cached_tokens, d.threshold,
                                     "probe", d.cache_transfer)
            return self._stay(d, "link_down")
        expected = link.transfer_s(state_bytes or 0, backlog_bytes)
        link.slow = expected > local_prefill_s + self.cfg.queue_margin_s
        if not link.slow:
            return d
        if link.share_probe(now):
            link.start_probe(now)
            return RouteDecision(REMOTE, d.compute_tokens, d.cached_tokens, d.threshold,
                                 "probe", d.cache_transfer)
        return self._stay(d, "link_slow")

    def _stay(self, d: RouteDecision, reason: str) -> RouteDecision:
        self.stats.routed[REMOTE] -= 1
        self.stats.routed[LOCAL] += 1
        self.stats.fallbacks += 1
        return RouteDecision(LOCAL, d.compute_tokens + d.cached_tokens, 0, d.threshold,
                             reason)

    def _decide(self, target, prompt_len, cached, t, short, move) -> RouteDecision:
        reason = ("cached" if cached and prompt_len > t else "short") if short else "fallback"
        return RouteDecision(target, prompt_len - cached, cached, t, reason, move)

    def observe(self, now: float, *, egress_gbps: float | None = None,
                link_util: float | None = None, remote_queue_s: float = 0.0,
                local_queue_s: float = 0.0, remote_up: bool = True) -> int:
        """Short-timescale control: feed measurements, get the (possibly moved) threshold.

        ``egress_gbps`` (or ``link_util`` directly, 0..1) is the recent egress rate on the
        inter-cluster link; ``remote_queue_s`` / ``local_queue_s`` the expected wait of a new
        prefill in each cluster (queued tokens over prefill throughput).
        """
        if link_util is None:
            link_util = 0.0 if egress_gbps is None else egress_gbps / self.cfg.link_gbps
        if link_util < 0 or remote_queue_s < 0 or local_queue_s < 0:
            raise ValueError("link utilisation and queue times must be >= 0")
        self.link_util, self.remote_up = float(link_util), bool(remote_up)
        self.remote_queue_s, self.local_queue_s = float(remote_queue_s), float(local_queue_s)
        c = self.cfg
        if c.adapt and remote_up:
            m = c.queue_margin_s
            busy = link_util > c.util_high or remote_queue_s > c.queue_slack * local_queue_s + m
            idle = (link_util < c.util_high and
                    local_queue_s > c.queue_slack * remote_queue_s + m)
            lo, hi = c.bounds()
            t, anchor = self.threshold, float(c.threshold)
            if busy:
                t = t * c.step
            elif idle:
                t = t / c.step
            elif t > anchor:       # no signal: back toward the long-timescale choice
                t = max(anchor, t / c.step)
            elif t < anchor:
                t = min(anchor, t * c.step)
            self.threshold = min(hi, max(lo, t))
        self.stats.threshold_history.append((now, self.t))
        return self.t


def build_policy(cfg: RouterConfig | None = None) -> PrfaasRouter:
    """The routing policy for ``cfg``: the one place the live router and the simulator
    get theirs from.

    Example:
        >>> build_policy(RouterConfig(threshold=1000)).t
        1000
    """
    return PrfaasRouter(cfg)


def recommend_pd_split(n_local: int, n_prefill: int, prefill_busy: float,
                       decode_busy: float) -> int:
    """Long timescale: local prefill instances that would balance the measured load.

    ``prefill_busy`` / ``decode_busy`` are the busy fractions (0..1) of the ``n_prefill``
    prefill and ``n_local - n_prefill`` decode instances over the last window. Work is
    busy fraction times instances; the split gives each role its share, at least one each.

    Example:
        >>> recommend_pd_split(8, 2, prefill_busy=0.9, decode_busy=0.3)
        4
    """
    if n_local < 2 or not 0 < n_prefill < n_local:
        raise ValueError(f"need n_local >= 2 and 0 < n_prefill < n_local, got {n_local}, "
                         f"{n_prefill}")
    if not (0 <= prefill_busy <= 1 and 0 <= decode_busy <= 1):
        raise ValueError("busy fractions must be in [0, 1]")
    wp, wd = prefill_busy * n_prefill, decode_busy * (n_local - n_prefill)
    if wp + wd == 0:
        return n_prefill
    return min(n_local - 1, max(1, round(n_local * wp / (wp + wd))))
