"""What a routing policy is: the :class:`RoutingPolicy` protocol, its decision, and the one
way a worker or instance is chosen (:func:`least_loaded`). Pure Python, no torch.

A policy answers two questions for every request: which cluster prefills it (:meth:`route`,
``"local"`` or ``"remote"``) and which member of a pool gets it (:meth:`pick`). The live
router (:mod:`hyla.disagg.live.router`) asks them of its HTTP workers, the simulator
(:mod:`hyla.disagg.sim.model`) of its simulated instances; both build the policy with
:func:`hyla.disagg.policy.build_policy`, so they run the same code.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class W:
    ...     name: str
    ...     queued_tokens: int = 0
    ...     inflight: int = 0
    >>> pool = [W("a", inflight=2), W("b", inflight=1), W("c", inflight=1)]
    >>> [least_loaded(pool).name, least_loaded(pool, turn=1).name,
    ...  least_loaded(pool, prefer="a").name]
    ['b', 'c', 'a']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

LOCAL = "local"
REMOTE = "remote"


@dataclass
class RouteDecision:
    """Where one request's prefill runs.

    ``compute_tokens`` is what that cluster must prefill (prompt minus the prefix it uses);
    ``cached_tokens`` the prefix it starts from; ``cache_transfer`` is None or
    ``(from_cluster, to_cluster, tokens)`` when a cached prefix must be moved first.
    ``reason`` is one of "short", "long", "fallback", "cached"; on a measured link also
    "probe" (remote to measure it), "link_slow" or "link_down" (kept local).
    """

    target: str
    compute_tokens: int
    cached_tokens: int
    threshold: int
    reason: str
    cache_transfer: tuple[str, str, int] | None = None


class Candidate(Protocol):
    """A worker or instance a policy may pick: a live worker (its URL as ``name``) or a
    simulated instance. ``queued_tokens``: prompt tokens it has yet to prefill;
    ``inflight``: requests it holds."""

    @property
    def name(self) -> str: ...
    @property
    def queued_tokens(self) -> int: ...
    @property
    def inflight(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def least_loaded(pool: Sequence[C], *, prefill: bool = True, prefer: str | None = None,
                 turn: int = 0) -> C | None:
    """The member of ``pool`` (already filtered to those that can take the request) that
    gets it, or None when the pool is empty.

    The one named ``prefer`` wins if present (it holds the prompt's prefix: cache-affine).
    Otherwise a prefill goes to the member with the least prefill work queued, then the
    fewest requests; a shipped state's decode (``prefill=False``) to the one with the fewest
    requests. Ties rotate with ``turn`` (0: the first one in ``pool`` order).
    """
    if not pool:
        return None
    if prefer is not None:
        for c in pool:
            if c.name == prefer:
                return c
    n = len(pool)
    best, best_key = None, None
    for i, c in enumerate(pool):
        key = (c.queued_tokens if prefill else 0, c.inflight, (i + turn) % n)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


@runtime_checkable
class RoutingPolicy(Protocol):
    """Decides, per request, where its prefill runs and which worker gets it.

    ``t`` is the current threshold (tokens; informational for policies without one).
    :meth:`observe` feeds measurements every few seconds (a policy may ignore them).
    """

    @property
    def t(self) -> int: ...

    def route(self, prompt_len: int, cached: dict[str, int] | None = None,
              now: float = 0.0) -> RouteDecision:
        """Local or remote for a prompt of ``prompt_len`` tokens; ``cached`` maps a cluster
        to the longest prefix of the prompt cached there."""
        ...

    def pick(self, pool: Sequence[C], *, prefill: bool = True, prefer: str | None = None,
             turn: int = 0) -> C | None:
        """The member of ``pool`` that gets the request (see :func:`least_loaded`)."""
        ...

    def observe(self, now: float, *, egress_gbps: float | None = None,
                link_util: float | None = None, remote_queue_s: float = 0.0,
                local_queue_s: float = 0.0, remote_up: bool = True) -> int:
        """Short-timescale measurements; returns the (possibly moved) threshold."""
        ...
