"""The Prefill-as-a-Service simulator (SimPy; imports no torch unless a profile is measured).

- :mod:`~hyla.disagg.sim.model`: :class:`Deployment`, :class:`SimConfig` and :class:`Sim`,
  one :class:`hyla.serve.scheduler.Scheduler` per simulated instance, routed by the same
  policy as the live router (:mod:`hyla.disagg.policy`);
- :mod:`~hyla.disagg.sim.hardware`: instance profiles, the model spec and the roofline step
  cost (or a measured profile's);
- :mod:`~hyla.disagg.sim.cpu`: a host CPU shared by processor sharing;
- :mod:`~hyla.disagg.sim.workload`: synthetic mixes and traces;
- :mod:`~hyla.disagg.sim.metrics`: one run's metrics; :mod:`~hyla.disagg.sim.report`:
  capacity under SLOs and grid searches; :mod:`~hyla.disagg.sim.setups`: named setups and
  the comparison ``hyla simulate`` prints;
- :mod:`~hyla.disagg.sim.profile`: measure a profile on hyla's own engine (torch);
- :mod:`~hyla.disagg.sim.kv_table`: Gbps of state/KV a prefill instance emits.
"""
