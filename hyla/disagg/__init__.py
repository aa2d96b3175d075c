"""Prefill/decode disaggregation (Prefill-as-a-Service): policy, live system, simulator.

Policy (pure Python, no torch; the simulator and the live router share it):
- :mod:`hyla.disagg.router`: which cluster prefills a request, and the threshold control.

Live system (separate OS processes, see ``hyla cluster``):
- :mod:`hyla.disagg.transfer`, :mod:`hyla.disagg.transfer_net`: a SequenceState shipped
  layer by layer over ZeroMQ, with per-layer checksums and a model fingerprint;
- :mod:`hyla.disagg.worker_prefill`, :mod:`hyla.disagg.worker_decode`: the two worker roles;
- :mod:`hyla.disagg.live_router`: the OpenAI-compatible front door with ``GET /cluster``;
- :mod:`hyla.disagg.cluster`: starts and supervises a router and both pools on one machine.

Simulation:
- :mod:`hyla.disagg.sim` (+ ``sim_hardware``, ``sim_workload``, ``sim_setups``,
  ``sim_report``): SimPy model of homogeneous PD, naive heterogeneous and PrfaaS
  deployments, driving one :class:`hyla.serve.scheduler.Scheduler` per instance;
- :mod:`hyla.disagg.kv_table`: Gbps of state/KV a prefill instance emits.

Importing this package imports no torch; the worker modules do.
"""
