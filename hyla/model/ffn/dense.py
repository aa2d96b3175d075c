"""``S``: the dense SwiGLU feed-forward, ``down(silu(gate(x)) * up(x))`` of width ``ffn_dim``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.ffn.base import FFN, register_ffn


@register_ffn("S")
class DenseFFN(FFN):
    """SwiGLU of ``cfg.ffn_dim`` (parameters ``gate_proj``, ``up_proj``, ``down_proj``, as
    Llama names them).

    Example:
        >>> from hyla.model.config import preset
        >>> DenseFFN(preset("debug"))(torch.randn(2, 3, 64)).shape
        torch.Size([2, 3, 64])
    """

    kind = "dense"

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @classmethod
    def parameters_count(cls, cfg) -> int:
        return 3 * cfg.d_model * cfg.ffn_dim

    @classmethod
    def active_parameters(cls, cfg) -> int:
        return cls.parameters_count(cfg)
