"""``C``: the gated short convolution of LFM2 (Liquid AI): ``in_proj`` maps x to ``B, C,
x``; ``y = C * conv(B * x)`` with a causal depthwise convolution of a few taps; ``out_proj``.

Its state per sequence is the convolution's last ``kernel - 1`` inputs (``B * x``): a few
rows of ``d_model``, of fixed size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, register_mixer
from hyla.ops.short_conv import causal_conv, causal_conv_step


@dataclass(frozen=True)
class ShortConvOptions:
    """Options of the ``C`` layer (``cfg.mixer_options["short_conv"]``): ``kernel`` taps
    (LFM2's conv_L_cache) and ``bias`` on the projections and the convolution (conv_bias).

    Example:
        >>> from hyla.model.config import HylaConfig
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="C", n_heads=4, ffn_dim=128)
        >>> ShortConvMixer.state_spec(cfg).fixed[0].shape
        (2, 64)
    """

    kernel: int = 3
    bias: bool = False

    def __post_init__(self):
        if not 1 <= self.kernel <= 64:
            raise ValueError(f"kernel must be in [1, 64] (a short convolution), got "
                             f"{self.kernel}")


@register_mixer("C")
class ShortConvMixer(Mixer):
    """LFM2's gated short convolution.

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = ShortConvMixer(preset("debug"))
        >>> layer(torch.randn(2, 5, 64), Context.train(torch.zeros(2, 5).long())).shape
        torch.Size([2, 5, 64])
    """

    kind = "short_conv"
    label = "short conv"
    state_label = "conv window"
    options_class = ShortConvOptions

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        d, o = cfg.d_model, self.opts
        self.in_proj = nn.Linear(d, 3 * d, bias=o.bias)
        self.conv = nn.Conv1d(d, d, o.kernel, groups=d, bias=o.bias)
        self.out_proj = nn.Linear(d, d, bias=o.bias)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        return StateSpec(cls.kind, fixed=(
            TensorSpec("conv", (cls.options(cfg).kernel - 1, cfg.d_model)),))

    @classmethod
    def token_flops(cls, cfg) -> float:
        return 2 * cls.options(cfg).kernel * cfg.d_model + 2 * cfg.d_model

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx, weight, bias = b * h, self.conv.weight[:, 0], self.conv.bias
        if ctx.mode == "train":
            y = causal_conv(bx, weight, ctx.cu_seqlens, bias=bias)[0]
        else:
            buf = ctx.buffers[self.layer_idx]
            window = ctx.load_fixed(buf["conv"])
            if ctx.mode == "prefill":
                y, window = causal_conv(bx, weight, ctx.cu_seqlens, window, bias=bias)
            else:
                y, window = causal_conv_step(bx, weight, window, bias=bias)
            ctx.store_fixed(buf["conv"], window.to(buf["conv"].dtype))
        return self.out_proj(c * y)
