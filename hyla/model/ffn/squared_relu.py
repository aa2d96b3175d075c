"""``R``: the ungated feed-forward with a squared ReLU, ``down(relu(up(x))^2)`` of width
``ffn_dim``: Nemotron-H's MLP (So et al., 2021, "Primer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.ffn.base import FFN, register_ffn


@register_ffn("R")
class SquaredReluFFN(FFN):
    """Two matrices (``up_proj``, ``down_proj``, as Nemotron-H names them) and relu^2.

    Example:
        >>> from hyla.model.config import preset
        >>> SquaredReluFFN(preset("debug"))(torch.randn(2, 3, 64)).shape
        torch.Size([2, 3, 64])
    """

    kind = "relu2"

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())

    @classmethod
    def parameters_count(cls, cfg) -> int:
        return 2 * cfg.d_model * cfg.ffn_dim

    @classmethod
    def active_parameters(cls, cfg) -> int:
        return cls.parameters_count(cfg)
