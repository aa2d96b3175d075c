"""Training: one loop (:mod:`.loop`) with pluggable objectives (:mod:`.objectives`; language
modelling, and the distillation stages of :mod:`.distill`), the ``hyla train`` run
(:mod:`.trainer`), the optimizers (:mod:`.optim`: Muon, single-device, row-sharded and on FSDP2
shards), how a run spreads over ranks (:mod:`.strategies`: FSDP2, DiLoCo, FoMoE) and its
checkpoints (:mod:`.checkpointing`).

Example:
    >>> from hyla.model import HylaLM, preset
    >>> from hyla.train import build_optimizers
    >>> muon, adamw = build_optimizers(HylaLM(preset("debug")))
"""

from hyla.train.optim import DistMuon, Muon, build_optimizers, newton_schulz, split_params


def __getattr__(name: str):
    # ShardedMuon imports torch.distributed.tensor (1-4 s): only when asked for, so commands
    # that merely import hyla.train (the CLI's parser) do not pay for it
    if name == "ShardedMuon":
        from hyla.train.optim.sharded_muon import ShardedMuon

        return ShardedMuon
    raise AttributeError(f"module 'hyla.train' has no attribute {name!r}")


__all__ = ["DistMuon", "Muon", "ShardedMuon", "build_optimizers", "newton_schulz",
           "split_params"]
