"""How a training run spreads over its ranks, one class a strategy behind one protocol
(:class:`~hyla.train.strategies.base.Strategy`):

- one process (W = 1, any ``--strategy``): :class:`~hyla.train.strategies.base.Strategy`;
- ``fsdp`` (the default at W > 1): FSDP2 shards of one model (:mod:`.fsdp`);
- ``diloco``: a full copy a rank, synced every H steps (:mod:`.diloco`);
- ``fomoe``: DiLoCo with each expert on R of W ranks (:mod:`.diloco`, :mod:`.fomoe`).

Plain data parallelism (DDP) is FSDP's special case here: FSDP2 on one rank group already
averages gradients the same way and holds 1/W of the state, so hyla has no separate DDP.
:mod:`.registry` picks one by name (:func:`~.registry.build_strategy`); :mod:`.report`
measures what each rank holds; :mod:`hyla.train.process_group` starts the ranks.
"""
