"""Training: one loop (``loop.py``) with pluggable objectives (language modelling,
distillation stages), Muon (single-device, row-sharded and on FSDP2 shards), parameter
routing, checkpoints (distributed: DCP, any world size).

Example:
    >>> from hyla.model import HylaLM, preset
    >>> from hyla.train import build_optimizers
    >>> muon, adamw = build_optimizers(HylaLM(preset("debug")))
"""

from hyla.train.muon import Muon, newton_schulz
from hyla.train.muon_dist import DistMuon
from hyla.train.param_groups import build_optimizers, split_params


def __getattr__(name: str):
    # ShardedMuon imports torch.distributed.tensor (1-4 s): only when asked for, so commands
    # that merely import hyla.train (the CLI's parser) do not pay for it
    if name == "ShardedMuon":
        from hyla.train.muon_fsdp import ShardedMuon

        return ShardedMuon
    raise AttributeError(f"module 'hyla.train' has no attribute {name!r}")

__all__ = ["DistMuon", "Muon", "ShardedMuon", "build_optimizers", "newton_schulz",
           "split_params"]
