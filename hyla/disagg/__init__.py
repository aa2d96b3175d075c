"""Prefill/decode disaggregation: the routing policy, and a discrete-event simulator of it.

- :mod:`hyla.disagg.router`: Prefill-as-a-Service routing policy (pure Python, no torch),
  shared by the simulator and the live router.
- :mod:`hyla.disagg.sim`: SimPy simulation of homogeneous PD, naive heterogeneous and
  PrfaaS deployments, driving one :class:`hyla.serve.scheduler.Scheduler` per instance.
- :mod:`hyla.disagg.kv_table`: Gbps of state/KV a prefill instance emits.

Nothing here imports torch at import time.
"""
