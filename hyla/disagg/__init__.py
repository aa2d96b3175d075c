"""Prefill/decode disaggregation (Prefill-as-a-Service): policy, live system, simulator.

- :mod:`hyla.disagg.policy` (torch-free): the routing policy behind the
  :class:`~hyla.disagg.policy.RoutingPolicy` protocol (which cluster prefills a request,
  and which worker gets it), its one config type and the threshold control; the live
  router and the simulator both build it with :func:`~hyla.disagg.policy.build_policy`.
- :mod:`hyla.disagg.live` (separate OS processes, see ``hyla cluster``): the prefill and
  decode workers, the state transfer over ZeroMQ, the OpenAI-compatible router and the
  cluster launcher.
- :mod:`hyla.disagg.sim` (SimPy): homogeneous PD, naive heterogeneous and PrfaaS
  deployments, each instance a :class:`hyla.serve.scheduler.Scheduler` priced by a
  hardware roofline or a measured profile; workloads, metrics and capacity searches.

Importing this package, :mod:`hyla.disagg.policy` or the simulator imports no torch; the
live workers do.
"""
