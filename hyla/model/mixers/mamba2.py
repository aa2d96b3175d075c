"""``S``: the Mamba-2 layer (Dao and Gu, 2024), whose recurrence is the state-space dual
(:mod:`hyla.ops.ssd`): one scalar decay a head, B and C shared by groups of heads.

The layer as Granite 4.0-H, Nemotron-H and Falcon-H1 ship it: ``in_proj`` maps x to
``[z | x B C | dt]``; the ``x B C`` channels go through a short causal depthwise
convolution and SiLU; ``dt = softplus(dt + dt_bias)`` clamped to ``time_step_limit``,
``A = -exp(A_log)``; the SSD with the ``D`` skip; a gated RMSNorm ``norm(y * silu(z))`` over
groups of channels; ``out_proj``.

State per sequence: the SSD's [heads, head_dim, state_size] float32 matrix and the
convolution's last ``conv_kernel - 1`` inputs, both of fixed size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, mamba_decay_init, register_mixer
from hyla.ops.short_conv import causal_conv, causal_conv_step
from hyla.ops.ssd import chunk_ssd, ssd_decode_step


@dataclass(frozen=True)
class Mamba2Options:
    """Options of the ``S`` layer (``cfg.mixer_options["mamba2"]``); the defaults make
    Mamba-2's usual layer of ``cfg``'s width (expand 2, head_dim 64, state 128, one group).

    Which transformers fields each option serves: ``n_heads`` = mamba_n_heads,
    ``head_dim`` = mamba_d_head, ``state_size`` = mamba_d_state / ssm_state_size,
    ``n_groups`` = mamba_n_groups / n_groups, ``conv_kernel`` = mamba_d_conv / conv_kernel,
    ``proj_bias`` = mamba_proj_bias / use_bias, ``conv_bias`` = mamba_conv_bias /
    use_conv_bias, ``time_step_limit``, ``norm_eps`` (None: ``cfg.norm_eps``),
    ``gated_norm`` (Falcon-H1's mamba_rms_norm; without it, ``y * silu(z)``),
    ``norm_before_gate`` (Falcon-H1's mamba_norm_before_gate: ``norm(y) * silu(z)`` instead
    of ``norm(y * silu(z))``).

    Example:
        >>> from hyla.model.config import HylaConfig
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="S", n_heads=4, ffn_dim=128,
        ...                  mixer_options={"mamba2": {"n_heads": 8, "head_dim": 16,
        ...                                            "state_size": 32}})
        >>> [e.shape for e in Mamba2Mixer.state_spec(cfg).fixed]
        [(8, 16, 32), (3, 192)]
    """

    n_heads: int | None = None          # None: 2 * d_model / head_dim
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    proj_bias: bool = False
    conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float | None = None
    gated_norm: bool = True
    norm_before_gate: bool = False

    def __post_init__(self):
        for name in ("head_dim", "state_size", "n_groups", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel > 64:
            raise ValueError(f"conv_kernel must be at most 64 (a short convolution), got "
                             f"{self.conv_kernel}")
        if self.n_heads is not None and self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1 or None, got {self.n_heads}")
        lo, hi = self.time_step_limit
        if not 0 <= lo <= hi:
            raise ValueError(f"time_step_limit must be (low, high) with 0 <= low <= high, got "
                             f"{self.time_step_limit}")


def mamba2_dims(cfg, o: Mamba2Options) -> tuple[int, int]:
    """(heads, inner width = heads * head_dim) of a layer; ValueError for what cannot hold."""
    heads = o.n_heads or max(1, 2 * cfg.d_model // o.head_dim)
    if heads % o.n_groups:
        raise ValueError(f"mixer_options['mamba2']: n_heads={heads} must be a multiple of "
                         f"n_groups={o.n_groups}")
    return heads, heads * o.head_dim


@register_mixer("S")
class Mamba2Mixer(Mixer):
    """The Mamba-2 layer: ``in_proj``, ``conv`` (over x, B, C), ``dt_bias``, ``A_log``,
    ``D``, ``norm`` (gated, per group), ``out_proj``.

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = Mamba2Mixer(preset("debug"))
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
    """

    kind = "mamba2"
    label = "Mamba-2"
    state_label = "SSM state"
    options_class = Mamba2Options

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        o = self.opts
        self.heads, self.inner = mamba2_dims(cfg, o)
        self.bc = o.n_groups * o.state_size
        channels = self.inner + 2 * self.bc
        self.in_proj = nn.Linear(cfg.d_model, self.inner + channels + self.heads,
                                 bias=o.proj_bias)
        self.conv = nn.Conv1d(channels, channels, o.conv_kernel, groups=channels,
                              bias=o.conv_bias)
        self.A_log, self.dt_bias = mamba_decay_init(self.heads)
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(self.inner)) if o.gated_norm else None
        self.out_proj = nn.Linear(self.inner, cfg.d_model, bias=o.proj_bias)

    @classmethod
    def check_config(cls, cfg) -> None:
        mamba2_dims(cfg, cls.options(cfg))

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        o = cls.options(cfg)
        heads, inner = mamba2_dims(cfg, o)
        channels = inner + 2 * o.n_groups * o.state_size
        return StateSpec(cls.kind, fixed=(
            TensorSpec("state", (heads, o.head_dim, o.state_size), torch.float32),
            TensorSpec("conv", (o.conv_kernel - 1, channels))))

    @classmethod
    def token_flops(cls, cfg) -> float:
        # the state update and readout (2 FLOPs a state entry each) and the convolution
        o = cls.options(cfg)
        heads, inner = mamba2_dims(cfg, o)
        return 4 * heads * o.head_dim * o.state_size + 2 * o.conv_kernel * (
            inner + 2 * o.n_groups * o.state_size)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        o = self.opts
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        z, xbc, dt = self.in_proj(x).split([self.inner, self.inner + 2 * self.bc, self.heads],
                                           dim=-1)
        dt = F.softplus(dt.to(f) + self.dt_bias.to(f)).clamp(*o.time_step_limit)
        A = -torch.exp(self.A_log.to(f))
        weight, bias = self.conv.weight[:, 0], self.conv.bias
        if ctx.mode == "train":
            xbc = F.silu(causal_conv(xbc, weight, ctx.cu_seqlens, bias=bias)[0])
            y, _ = chunk_ssd(*self._split(xbc, dt, A, B, T), cu_seqlens=ctx.cu_seqlens,
                             chunk_size=self.cfg.chunk_size)
        else:
            buf = ctx.buffers[self.layer_idx]
            state, window = ctx.load_fixed(buf["state"]), ctx.load_fixed(buf["conv"])
            if ctx.mode == "prefill":
                xbc, window = causal_conv(xbc, weight, ctx.cu_seqlens, window, bias=bias)
                y, state = chunk_ssd(*self._split(F.silu(xbc), dt, A, B, T),
                                     initial_state=state, output_final_state=True,
                                     cu_seqlens=ctx.cu_seqlens, chunk_size=self.cfg.chunk_size)
            else:                              # one token for each of B sequences
                xbc, window = causal_conv_step(xbc, weight, window, bias=bias)
                xs, dts, _, Bs, Cs, D = self._split(F.silu(xbc), dt, A, B, T)
                y = ssd_decode_step(xs[:, 0], dts[:, 0], A, Bs[:, 0], Cs[:, 0], D,
                                    state)[:, None]      # updates ``state`` in place
            ctx.store_fixed(buf["state"], state)
            ctx.store_fixed(buf["conv"], window.to(buf["conv"].dtype))
        y, gate = y.reshape(B, T, self.inner).to(f), F.silu(z.to(f))
        late = self.norm_weight is not None and o.norm_before_gate
        if not late:
            y = y * gate
        if self.norm_weight is not None:       # RMSNorm over each group of channels
            g = y.view(B, T, o.n_groups, -1)
            eps = self.cfg.norm_eps if o.norm_eps is None else o.norm_eps
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
            y = g.view(B, T, self.inner) * self.norm_weight.to(f)
        if late:
            y = y * gate
        return self.out_proj(y.to(x.dtype))

    def _split(self, xbc: torch.Tensor, dt, A, B: int, T: int):
        """The SSD's arguments (x, dt, A, B, C, D) from the convolved channels."""
        o = self.opts
        xs, Bm, Cm = xbc.split([self.inner, self.bc, self.bc], dim=-1)
        return (xs.reshape(B, T, self.heads, o.head_dim), dt, A,
                Bm.reshape(B, T, o.n_groups, o.state_size),
                Cm.reshape(B, T, o.n_groups, o.state_size), self.D)
