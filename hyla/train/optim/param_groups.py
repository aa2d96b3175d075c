"""Which parameters Muon updates and which AdamW does, and the pair of optimizers.

Muon orthogonalises a matrix that maps one hidden representation to another. So:

- Muon: every 2-D weight inside the blocks: q/k/v/g/o projections, the SwiGLU matrices and
  both factors of the GLA gate's low-rank projection, ``gk_proj.0.weight [16, d]`` and
  ``gk_proj.1.weight [key_dim, 16]``. These are ordinary (if thin) linear maps between hidden
  spaces; NS gives their 16 singular directions equal step size, like any other matrix, and
  the 0.2 * sqrt(max(A, B)) scale keeps the update's RMS at AdamW's.
- AdamW: the token embedding and the output head (a lookup table and a classifier over the
  vocabulary, not hidden-to-hidden maps: the usual Muon recipe), every norm weight, the gate
  bias ``gk_proj.1.bias`` and any other non-2-D parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.model.parameter_kinds import split_params
from hyla.train.optim.muon import Muon

__all__ = ["build_optimizers", "split_params"]


def build_optimizers(model: nn.Module, *, lr_muon: float = 0.02, lr_adamw: float = 3e-4,
                     weight_decay: float = 0.0, momentum: float = 0.95,
                     betas: tuple[float, float] = (0.9, 0.95),
                     ns_dtype: torch.dtype = torch.bfloat16,
                     ) -> tuple[Muon, torch.optim.AdamW]:
    """Muon for the hidden matrices and AdamW for the rest (see :func:`split_params`).

    ``weight_decay`` applies to both, but AdamW decays only its 2-D tables (embedding, head),
    not norms and biases. Step both optimizers every iteration.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> muon, adamw = build_optimizers(HylaLM(preset("debug")), lr_adamw=1e-3)
        >>> type(muon).__name__, len(adamw.param_groups)
        ('Muon', 2)
    """
    for name, value in (("lr_muon", lr_muon), ("lr_adamw", lr_adamw),
                        ("weight_decay", weight_decay)):
        if not 0 <= value < float("inf"):     # inf trains to NaN at once
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    muon_params, adamw_params = split_params(model)
    if not muon_params:
        raise ValueError("model has no 2-D hidden weights for Muon")
    muon = Muon([p for _, p in muon_params], lr=lr_muon, momentum=momentum,
                weight_decay=weight_decay, ns_dtype=ns_dtype)
    decay = [p for _, p in adamw_params if p.ndim >= 2]
    no_decay = [p for _, p in adamw_params if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=lr_adamw, betas=betas)
    return muon, adamw
