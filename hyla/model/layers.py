"""Building blocks shared by the blocks and the mixers: RMSNorm, SwiGLU, rotary embedding.

The mixers themselves (GLA, attention, ...) live in :mod:`hyla.model.mixers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32.

    Example:
        >>> RMSNorm(8)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); [..., d_model] -> [..., d_model]."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by absolute ``positions`` [B, T] or [T] (half-split layout).

    The half-split ("rotate_half") layout is Llama's / Hugging Face's, so weights port as is.
    Frequencies are computed on the fly in float32: no buffer to move between devices or to
    materialise after construction on the meta device.

    Example:
        >>> x = torch.randn(1, 5, 2, 8)
        >>> torch.allclose(apply_rotary(x, torch.zeros(5, dtype=torch.long), 1e4), x)
        True
    """
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.to(x.device, torch.float32)[..., None] * inv_freq     # [(B,) T, D/2]
    angles = angles.reshape(-1 if positions.dim() == 2 else 1, x.shape[1], 1, D // 2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
