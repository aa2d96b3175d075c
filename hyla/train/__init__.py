"""Training: one loop (``loop.py``) with pluggable objectives (language modelling,
distillation stages), Muon (single-device and sharded), parameter routing, checkpoints.

Example:
    >>> from hyla.model import HylaLM, preset
    >>> from hyla.train import build_optimizers
    >>> muon, adamw = build_optimizers(HylaLM(preset("debug")))
"""

from hyla.train.muon import Muon, newton_schulz
from hyla.train.muon_dist import DistMuon
from hyla.train.param_groups import build_optimizers, split_params

__all__ = ["DistMuon", "Muon", "build_optimizers", "newton_schulz", "split_params"]
