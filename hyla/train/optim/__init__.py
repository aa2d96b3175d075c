"""The optimizers of a training run: Muon (:mod:`.muon`), its distributed forms on row-sharded
gradients (:mod:`.dist_muon`: ``all_gather`` or ``all_to_all``) and on FSDP2 shards
(:mod:`.sharded_muon`), which parameters each optimizer takes (:mod:`.param_groups`), the pair
a run builds from its config (:mod:`.build`) and the traffic measurement behind ``hyla bench
muon-comm`` (:mod:`.bench`)."""

from hyla.train.optim.build import run_optimizers
from hyla.train.optim.dist_muon import DistMuon
from hyla.train.optim.muon import Muon, newton_schulz
from hyla.train.optim.param_groups import build_optimizers, split_params


def __getattr__(name: str):
    # ShardedMuon imports torch.distributed.tensor (1-4 s): only when asked for
    if name == "ShardedMuon":
        from hyla.train.optim.sharded_muon import ShardedMuon

        return ShardedMuon
    raise AttributeError(f"module 'hyla.train.optim' has no attribute {name!r}")


__all__ = ["DistMuon", "Muon", "ShardedMuon", "build_optimizers", "newton_schulz",
           "run_optimizers", "split_params"]
