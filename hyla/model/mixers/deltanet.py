"""``D``: Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025); ``K``: the same layer with a
decay per key channel (Kimi Delta Attention's gate).

The layer as the literature builds it: q, k, v projections, each through a short causal
depthwise convolution and SiLU; q and k L2-normalised; ``beta = sigmoid(b_proj(x))``; the
log decay ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` (Mamba2's A and dt), one a
head (``D``) or one a key channel (``K``); the gated delta rule
(:mod:`hyla.ops.deltanet`); output ``o_proj(rmsnorm_per_head(o) * silu(g_proj(x)))``.
:class:`DeltaOptions` (``cfg.mixer_options["gated_delta"]`` / ``["kda"]``) gives the
shapes and variants that the transformers families ship (Qwen3-Next, Qwen3.5, OLMo hybrid,
Kimi Linear, Ring-2.5); the defaults are hyla's own layer.

State per sequence: the [value heads, head_k_dim, head_v_dim] float32 matrix and the short
convolution's last ``kernel - 1`` inputs (q, k and v channels), both of fixed size, so the
serving engine, prefix-cache snapshots and state transfer carry them like any fixed state.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm
from hyla.model.mixers.base import (
    Mixer,
    StateSpec,
    TensorSpec,
    expand_kv_heads,
    mamba_decay_init,
    register_mixer,
)
from hyla.model.mixers.delta_options import CONV_KERNEL, DeltaOptions, delta_dims
from hyla.ops.deltanet import chunk_gated_delta, delta_decode_step, l2norm
from hyla.ops.short_conv import causal_conv, causal_conv_step

__all__ = ["CONV_KERNEL", "DeltaOptions", "GatedDeltaMixer", "KDAMixer", "delta_dims",
           "slow_dt_bias"]
# Tokens: the fastest and slowest decay a layer starts from when it is initialised from an
# attention layer (distillation), spread log-uniformly over heads (D) or key channels (K).
TIMESCALES = (16.0, 4096.0)


@register_mixer("D")
class GatedDeltaMixer(Mixer):
    """Gated DeltaNet: one decay a head. q, k: d_model -> key_dim; v, g: d_model ->
    value_dim (``cfg.expand_k``, ``cfg.expand_v`` as for GLA, so the state has GLA's shape,
    unless :class:`DeltaOptions` set the heads and dims).

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = GatedDeltaMixer(preset("debug"))
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
    """

    kind = "gated_delta"
    label = "Gated DeltaNet"
    options_class = DeltaOptions
    per_channel = False         # one decay a key channel (KDA) instead of one a head
    # The form built when cfg.linear_window > 0 (hyla.model.mixers.linearised.delta sets it, on
    # this class and on KDAMixer: each class's own, not inherited).
    windowed: ClassVar[type[GatedDeltaMixer] | None] = None

    def __new__(cls, cfg=None, *args, **kwargs):
        # cfg None: copy / pickle re-creating an instance (they call __new__ bare)
        form = cls.__dict__.get("windowed")
        if form is not None and getattr(cfg, "linear_window", 0):
            cls = form
        return super().__new__(cls)

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        o = self.opts
        d = cfg.d_model
        self.hk, self.hv, self.dk, self.dv = delta_dims(cfg, o)
        kd, vd, H = self.hk * self.dk, self.hv * self.dv, self.hv
        self.q_proj = nn.Linear(d, kd, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        channels = 2 * kd + vd
        self.conv = nn.Conv1d(channels, channels, o.conv_kernel, groups=channels, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        decays = H * self.dk if self.per_channel else H
        self.a_down = nn.Linear(d, o.decay_rank, bias=False) if o.decay_rank else None
        self.a_proj = nn.Linear(o.decay_rank or d, decays, bias=False)
        self.A_log, self.dt_bias = mamba_decay_init(H, decays)   # Mamba-2's
        self.g_down = nn.Linear(d, o.gate_rank, bias=False) if o.gate_rank else None
        self.g_proj = nn.Linear(o.gate_rank or d, vd, bias=False)
        self.o_norm = RMSNorm(self.dv, eps=cfg.norm_eps if o.o_norm_eps is None
                              else o.o_norm_eps)
        self.o_proj = nn.Linear(vd, d, bias=False)

    @classmethod
    def check_config(cls, cfg) -> None:
        delta_dims(cfg, cls.options(cfg))

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        if cfg.linear_window and cls.__dict__.get("windowed") is not None:
            return cls.windowed.state_spec(cfg)
        opts = cls.options(cfg)
        hk, hv, dk, dv = delta_dims(cfg, opts)
        conv = (opts.conv_kernel - 1, 2 * hk * dk + hv * dv)
        return StateSpec(cls.kind, fixed=(TensorSpec("state", (hv, dk, dv), torch.float32),
                                          TensorSpec("conv", conv)))

    @classmethod
    def token_flops(cls, cfg) -> float:
        # S^T k, the rank-1 update and the readout (2 FLOPs a state entry each), the conv
        if cfg.linear_window and cls.__dict__.get("windowed") is not None:
            return cls.windowed.token_flops(cfg)
        opts = cls.options(cfg)
        hk, hv, dk, dv = delta_dims(cfg, opts)
        return 6 * hv * dk * dv + 2 * opts.conv_kernel * (2 * hk * dk + hv * dv)

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """q, k, v and o from the teacher's attention (needs ``expand_k = expand_v = 1``, so
        each head has the teacher's head dim; KV heads repeated for every query head). The
        convolution starts as the identity (it passes the current token through), the decays
        input-independent and slow (:func:`slow_dt_bias`: 16 to 4,096 tokens), ``beta`` at
        0.5 (``b_proj = 0``). Rotary positions, softmax and the delta rule's overwriting are
        what distillation must make up for; ``g_proj`` and the output norm stay fresh."""
        heads, H = teacher.cfg.n_kv_heads, self.cfg.n_heads
        self.q_proj.weight.copy_(teacher.q_proj.weight)
        self.o_proj.weight.copy_(teacher.o_proj.weight)
        self.k_proj.weight.copy_(expand_kv_heads(teacher.k_proj.weight, heads, H))
        self.v_proj.weight.copy_(expand_kv_heads(teacher.v_proj.weight, heads, H))
        self.conv.weight.zero_()
        self.conv.weight[:, 0, -1] = 1.0
        self.b_proj.weight.zero_()
        self.a_proj.weight.zero_()
        self.A_log.zero_()
        self.dt_bias.copy_(slow_dt_bias(self.cfg, self.per_channel))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> log decays float32 <= 0: [B, T, H] (``D``) or [B, T, H, K]
        (H the value heads)."""
        B, T, _ = x.shape
        a = self.a_proj(x if self.a_down is None else self.a_down(x))
        a = a.float() + self.dt_bias.float()
        A = self.A_log.float().exp()
        if self.per_channel:
            a, A = a.view(B, T, self.hv, -1), A[:, None]
        if self.opts.safe_gate:
            return self.opts.lower_bound * torch.sigmoid(A * a)
        return -A * F.softplus(a)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.log_decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if self.opts.beta_scale != 1.0:
            beta = beta * self.opts.beta_scale
        if ctx.mode == "train":
            qkv = F.silu(causal_conv(qkv, self.conv.weight[:, 0], ctx.cu_seqlens)[0])
            q, k, v = self._split(qkv, B, T)
            o, _ = chunk_gated_delta(q, k, v, g, beta, cu_seqlens=ctx.cu_seqlens,
                                     chunk_size=c.chunk_size)
        else:
            buf = ctx.buffers[self.layer_idx]
            state, window = ctx.load_fixed(buf["state"]), ctx.load_fixed(buf["conv"])
            if ctx.mode == "prefill":
                qkv, window = causal_conv(qkv, self.conv.weight[:, 0], ctx.cu_seqlens, window)
                q, k, v = self._split(F.silu(qkv), B, T)
                o, state = chunk_gated_delta(q, k, v, g, beta, initial_state=state,
                                             output_final_state=True, cu_seqlens=ctx.cu_seqlens,
                                             chunk_size=c.chunk_size)
            else:                              # one token for each of B sequences
                qkv, window = causal_conv_step(qkv, self.conv.weight[:, 0], window)
                q, k, v = self._split(F.silu(qkv), B, T)
                o = delta_decode_step(q, k, v, g, beta, state)     # updates ``state`` in place
            ctx.store_fixed(buf["state"], state)
            ctx.store_fixed(buf["conv"], window.to(buf["conv"].dtype))
        # The gated norm norm(o) * w * act(gate), in float32 (Kimi's and Ring's order; Qwen
        # and OLMo round norm(o) to the model dtype before * w: equal in float32).
        gate = self.g_proj(x if self.g_down is None else self.g_down(x)).float()
        act = F.silu if self.opts.gate_act == "silu" else torch.sigmoid
        o = self.o_norm(o.float()) * act(gate.view(B, T, self.hv, self.dv))
        return self.o_proj(o.to(x.dtype).reshape(B, T, self.hv * self.dv))

    def _split(self, qkv: torch.Tensor, B: int, T: int):
        kd = self.hk * self.dk
        q, k, v = qkv.split([kd, kd, self.hv * self.dv], dim=-1)
        q, k = l2norm(q.reshape(B, T, self.hk, -1)), l2norm(k.reshape(B, T, self.hk, -1))
        if self.hv != self.hk:          # each key head serves its group of value heads
            q = q.repeat_interleave(self.hv // self.hk, dim=2)
            k = k.repeat_interleave(self.hv // self.hk, dim=2)
        return q, k, v.reshape(B, T, self.hv, -1)


@register_mixer("K")
class KDAMixer(GatedDeltaMixer):
    """The gated delta rule with one decay a key channel (Kimi Linear's KDA gate); otherwise
    the ``D`` layer (same :class:`DeltaOptions`, read from ``cfg.mixer_options["kda"]``).

    Example:
        >>> from hyla.model.config import preset
        >>> KDAMixer(preset("debug")).log_decay(torch.randn(2, 3, 64)).shape
        torch.Size([2, 3, 4, 8])
    """

    kind = "kda"
    label = "KDA"
    per_channel = True
    windowed: ClassVar[type[GatedDeltaMixer] | None] = None


def slow_dt_bias(cfg, per_channel: bool) -> torch.Tensor:
    """dt biases giving decays over 16 ... 4,096 tokens, log-uniformly, with ``A = 1`` and
    ``a_proj = 0``: over heads ([n_heads]), or over each head's key channels ([key_dim]).

    A state that keeps ``exp(-1 / tau)`` a token needs ``softplus(dt_bias) = 1 / tau``, i.e.
    ``dt_bias = log(expm1(1 / tau))``.

    Example:
        >>> from hyla.model.config import preset
        >>> slow_dt_bias(preset("debug"), False).shape, slow_dt_bias(preset("debug"), True).shape
        (torch.Size([4]), torch.Size([32]))
    """
    lo, hi = TIMESCALES
    n = cfg.head_k_dim if per_channel else cfg.n_heads
    tau = torch.logspace(math.log10(lo), math.log10(hi), n, dtype=torch.float64)
    b = torch.log(torch.expm1(1.0 / tau))
    return (b.repeat(cfg.n_heads) if per_channel else b).float()
