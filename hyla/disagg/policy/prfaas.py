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
  utilisation and the remote and local prefill queues move ``t``. A busy link or a remote
  queue longer than the local one raises ``t`` (offload less); an idle link and a local
  queue longer than the remote one lower it (offload more). Multiplicative steps, clamped to
  ``[t_min, t_max]``.
- **Fallback.** While the remote pool is down, or its queue exceeds
  ``cfg.max_remote_queue_s``, every request stays local.
- **Long timescale** (:func:`recommend_pd_split`): from the measured busy fractions of the
  local prefill and decode instances, how many of the local instances should prefill. The
  simulator searches it directly; the live router reports it as a recommendation.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hyla.disagg.policy.base import LOCAL, REMOTE, C, RouteDecision, least_loaded


@dataclass(kw_only=True)
class RouterConfig:
    """Knobs of :class:`PrfaasRouter` (all lengths in tokens, times in seconds): the one
    config type of the routing policy, held as-is by the live router
    (``LiveRouterConfig.policy``) and by a simulated deployment (``Deployment.policy``).

    ``threshold`` is the initial ``t``; ``t_min`` its floor (None: 256, or ``threshold`` if
    lower); ``link_gbps`` the egress link's capacity, used to turn measured Gbps into a
    utilisation (the simulator sets it to its simulated link's). ``adapt=False`` freezes
    ``t`` (a static threshold).
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
    adapt: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.t_floor <= self.threshold <= self.t_max:
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
            if busy:
                self.threshold = min(c.t_max, self.threshold * c.step)
            elif idle:
                self.threshold = max(c.t_floor, self.threshold / c.step)
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
