"""The live Prefill-as-a-Service system: separate OS processes (see ``hyla cluster``).

- :mod:`~hyla.disagg.live.worker.prefill`: the prefill role, an
  :class:`~hyla.serve.engine.Engine` running prefill-only requests whose states it ships;
- :mod:`~hyla.disagg.live.worker.decode`: the decode (PD) role, which also decodes shipped
  states (:meth:`~hyla.serve.engine.Engine.add_prefilled`);
- :mod:`~hyla.disagg.live.transfer.frames` (wire format and its checks),
  :mod:`~hyla.disagg.live.transfer.net` (the receiver) and
  :mod:`~hyla.disagg.live.transfer.sender` (the zmq sockets): a whole
  :class:`~hyla.model.state.SequenceState` per transfer, its flattened buffer in chunks,
  acknowledged by the receiver;
- :mod:`~hyla.disagg.live.router.core`, :mod:`~hyla.disagg.live.router.remote`,
  :mod:`~hyla.disagg.live.router.links` and :mod:`~hyla.disagg.live.router.app`: the
  OpenAI-compatible front door, routing by :mod:`hyla.disagg.policy` on the measured
  link of each prefill -> decode path;
- :mod:`~hyla.disagg.live.auth` and :mod:`~hyla.disagg.live.internal_auth`: secrets, and
  the HMAC every ``/internal/*`` call carries when a cluster secret is set;
- :mod:`~hyla.disagg.live.netlab` and :mod:`~hyla.disagg.live.netlab.cluster`: the
  cluster across two network namespaces and a shaped, cuttable, lossy link (tests and
  benchmarks, root only);
- :mod:`~hyla.disagg.live.cluster`: starts and supervises a router and both pools on one
  machine.

Importing this package imports nothing; its modules import torch, fastapi or zmq.
"""
