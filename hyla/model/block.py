"""A block of the stack: a mixer and an FFN, each behind a norm and a residual add."""

from __future__ import annotations

import torch
from torch import nn

from hyla.model.config import HylaConfig
from hyla.model.context import Context
from hyla.model.ffn import FFNS
from hyla.model.layers import RMSNorm
from hyla.model.mixers import MIXERS


class Block(nn.Module):
    """A block: x + mixer(norm(x), ctx), then x + mlp(norm(x)) (``norm_placement="pre"``),
    or x + norm(mixer(x, ctx)), then x + norm(mlp(x)) (``"post"``). ``mlp`` is the layer's
    FFN kind (:data:`hyla.model.ffn.FFNS`, ``cfg.ffn_layers``)."""

    def __init__(self, cfg: HylaConfig, letter: str, layer_idx: int):
        super().__init__()
        layer = cfg.layer_config(layer_idx)
        self.pre_norm = layer.norm_placement == "pre"
        self.mixer_norm = RMSNorm(cfg.d_model, eps=layer.norm_eps,
                                  zero_centred=cfg.norm_zero_centred)
        self.mixer = MIXERS[letter](layer, layer_idx)
        self.fixed_state = bool(MIXERS[letter].state_spec(layer).fixed)
        ffn = FFNS[cfg.ffn_letter(layer_idx)]
        self.mlp_norm = RMSNorm(cfg.d_model, eps=layer.norm_eps,
                                zero_centred=cfg.norm_zero_centred) if ffn.present else None
        self.mlp = ffn(layer, layer_idx)
        self.scale = layer.residual_scale

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        s = self.scale
        if self.pre_norm:
            x = x + self._scaled(self._mix(self.mixer_norm(x), ctx), s)
            if self.mlp_norm is None:       # no FFN half (ffn letter "N")
                return x
            return x + self._scaled(self.mlp(self.mlp_norm(x)), s)
        x = x + self._scaled(self.mixer_norm(self._mix(x, ctx)), s)
        if self.mlp_norm is None:
            return x
        return x + self._scaled(self.mlp_norm(self.mlp(x)), s)

    def _mix(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        if not (ctx.chain and self.fixed_state):
            return self.mixer(x, ctx)
        # rows that may continue one another (Context.chain): the state takes one at a time
        return torch.cat([self.mixer(x[b:b + 1], ctx.row(b)) for b in range(x.shape[0])])

    @staticmethod
    def _scaled(y: torch.Tensor, s: float) -> torch.Tensor:
        return y if s == 1.0 else y * s
