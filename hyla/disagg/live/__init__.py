"""The live Prefill-as-a-Service system: separate OS processes (see ``hyla cluster``).

- :mod:`~hyla.disagg.live.worker_prefill`: the prefill role, an
  :class:`~hyla.serve.engine.Engine` running prefill-only requests whose states it ships;
- :mod:`~hyla.disagg.live.worker_decode`: the decode (PD) role, which also decodes shipped
  states (:meth:`~hyla.serve.engine.Engine.add_prefilled`);
- :mod:`~hyla.disagg.live.transfer` (wire format and its checks) and
  :mod:`~hyla.disagg.live.transfer_net` (the zmq sockets): a whole
  :class:`~hyla.model.state.SequenceState` per transfer, its flattened buffer in chunks;
- :mod:`~hyla.disagg.live.router` and :mod:`~hyla.disagg.live.router_app`: the
  OpenAI-compatible front door, routing by :mod:`hyla.disagg.policy`;
- :mod:`~hyla.disagg.live.cluster`: starts and supervises a router and both pools on one
  machine.

Importing this package imports nothing; its modules import torch, fastapi or zmq.
"""
