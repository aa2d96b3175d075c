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
from hyla.train.muon_fsdp import ShardedMuon
from hyla.train.param_groups import build_optimizers, split_params

__all__ = ["DistMuon", "Muon", "ShardedMuon", "build_optimizers", "newton_schulz",
           "split_params"]
