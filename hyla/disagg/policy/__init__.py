"""The routing policy of Prefill-as-a-Service, torch-free, used as-is by the live router and
the simulator.

- :mod:`~hyla.disagg.policy.base`: the :class:`RoutingPolicy` protocol (local or remote
  prefill, and which worker), :class:`RouteDecision`, :func:`least_loaded`;
- :mod:`~hyla.disagg.policy.prfaas`: :class:`RouterConfig` (the policy's one config type),
  :class:`PrfaasRouter` (threshold on the incremental prompt length, adapted to the link and
  the queues), :func:`build_policy` (how both callers get one) and
  :func:`recommend_pd_split` (the long-timescale P/D split);
- :mod:`~hyla.disagg.policy.prefix_index`: the router's estimate of the workers' prefix
  caches;
- :mod:`~hyla.disagg.policy.link`: the measured link of each prefill -> decode path
  (:class:`LinkEstimate`: throughput and latency estimate, circuit breaker, probes).

Example:
    >>> policy = build_policy(RouterConfig(threshold=1000))
    >>> isinstance(policy, RoutingPolicy), policy.route(5000).target
    (True, 'remote')
"""

from hyla.disagg.policy.base import LOCAL, REMOTE, RouteDecision, RoutingPolicy, least_loaded
from hyla.disagg.policy.link import LinkConfig, LinkEstimate, StateSize
from hyla.disagg.policy.prfaas import (
    ALL_LOCAL,
    PrfaasRouter,
    RouterConfig,
    build_policy,
    recommend_pd_split,
)

__all__ = ["ALL_LOCAL", "LOCAL", "REMOTE", "LinkConfig", "LinkEstimate", "PrfaasRouter",
           "RouteDecision", "RouterConfig", "RoutingPolicy", "StateSize", "build_policy",
           "least_loaded", "recommend_pd_split"]
