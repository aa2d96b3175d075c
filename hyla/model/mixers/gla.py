"""``G``: gated linear attention (Yang et al. 2024), as flash-linear-attention's layer.

State per sequence: one [n_heads, head_k_dim, head_v_dim] float32 matrix, whatever the
context length.
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
    register_mixer,
)
from hyla.ops.gla import chunk_gla, gla_decode_step

# Tokens: the fastest and slowest forgetting of the gates a layer starts from when it is
# initialised from an attention layer (distillation).
TIMESCALES = (16.0, 4096.0)


@register_mixer("G")
class GLAMixer(Mixer):
    """q, k: d_model -> key_dim; v: d_model -> value_dim; log forget gate
    ``gk = logsigmoid(W2 W1 x + b) / gate_logit_normalizer`` through a rank-16 bottleneck;
    output ``o_proj(rmsnorm_per_head(o) * swish(g_proj(x)))``. No positional encoding.

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = GLAMixer(preset("debug"))
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
    """

    kind = "gla"
    label = "GLA"
    # The form built when cfg.linear_window > 0 (hyla.model.mixers.linearised.gla sets it).
    windowed: ClassVar[type[GLAMixer] | None] = None

    def __new__(cls, cfg=None, *args, **kwargs):
        # cfg None: copy / pickle re-creating an instance (they call __new__ bare)
        if cls is GLAMixer and getattr(cfg, "linear_window", 0) and cls.windowed is not None:
            cls = cls.windowed
        return super().__new__(cls)

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        d, kd, vd = cfg.d_model, cfg.key_dim, cfg.value_dim
        self.q_proj = nn.Linear(d, kd, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, kd, bias=True))
        self.g_proj = nn.Linear(d, vd, bias=False)
        self.g_norm = RMSNorm(cfg.head_v_dim, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(vd, d, bias=False)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        if cfg.linear_window and cls is GLAMixer:
            return cls.windowed.state_spec(cfg)
        shape = (cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim)
        return StateSpec(cls.kind, fixed=(TensorSpec("state", shape, torch.float32),))

    @classmethod
    def token_flops(cls, cfg) -> float:
        if cfg.linear_window and cls is GLAMixer:
            return cls.windowed.token_flops(cfg)
        return 4 * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim     # update + readout

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """q, k, v and o from the teacher's attention (needs ``expand_k = expand_v = 1``, so
        each head has the teacher's head dim; KV heads repeated for every query head). GLA
        uses no positions: the rotary part of the teacher is what distillation must make up
        for. The forget gates start input-independent (``gk_proj.1.weight = 0``) with
        :func:`slow_gate_bias`: slow forgetting, close to the long memory of the attention
        it replaces. ``g_proj`` and the output norm keep their fresh initialisation."""
        heads, H = teacher.cfg.n_kv_heads, self.cfg.n_heads
        self.q_proj.weight.copy_(teacher.q_proj.weight)
        self.o_proj.weight.copy_(teacher.o_proj.weight)
        self.k_proj.weight.copy_(expand_kv_heads(teacher.k_proj.weight, heads, H))
        self.v_proj.weight.copy_(expand_kv_heads(teacher.v_proj.weight, heads, H))
        self.gk_proj[1].weight.zero_()
        self.gk_proj[1].bias.copy_(slow_gate_bias(self.cfg))

    def log_forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> log forget gates [B, T, H, K] float32, each in (-inf, 0)."""
        B, T, _ = x.shape
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.cfg.gate_logit_normalizer
        return gk.view(B, T, self.cfg.n_heads, self.cfg.head_k_dim)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        H, K, V = c.n_heads, c.head_k_dim, c.head_v_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        gk = self.log_forget_gate(x)
        if ctx.mode == "train":
            o, _ = chunk_gla(q, k, v, gk, cu_seqlens=ctx.cu_seqlens, chunk_size=c.chunk_size)
        else:
            buf = ctx.buffers[self.layer_idx]["state"]
            state = ctx.load_fixed(buf)
            if ctx.mode == "prefill":
                o, state = chunk_gla(q, k, v, gk, initial_state=state, output_final_state=True,
                                     cu_seqlens=ctx.cu_seqlens, chunk_size=c.chunk_size)
            else:
                o = gla_decode_step(q, k, v, gk, state)        # updates ``state`` in place
            ctx.store_fixed(buf, state)
        o = self.g_norm(o) * F.silu(self.g_proj(x).view_as(o))
        return self.o_proj(o.reshape(B, T, c.value_dim))


def slow_gate_bias(cfg, channels: int | None = None) -> torch.Tensor:
    """Gate biases [n_heads * channels] (``channels`` default ``head_k_dim``): per head, the
    channels forget over 16 ... 4,096 tokens, log-uniformly (:func:`gate_bias`).

    Example:
        >>> from hyla.model.config import preset
        >>> slow_gate_bias(preset("debug")).shape
        torch.Size([32])
    """
    lo, hi = TIMESCALES
    tau = torch.logspace(math.log10(lo), math.log10(hi), channels or cfg.head_k_dim,
                         dtype=torch.float64)
    return gate_bias(tau.repeat(cfg.n_heads, 1), cfg.gate_logit_normalizer)


def gate_bias(taus: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Gate biases [H * K] for channel timescales ``taus`` [H, K] (tokens).

    The log forget gate is ``logsigmoid(b) / normalizer``; a channel that keeps ``exp(-1 /
    tau)`` of its memory a token needs ``logsigmoid(b) = -normalizer / tau``, i.e.
    ``b = -log(expm1(normalizer / tau))``.

    Example:
        >>> b = gate_bias(torch.tensor([[100.0]]), 16.0)
        >>> round(float(F.logsigmoid(b) / 16 * 100), 4)
        -1.0
    """
    return (-torch.log(torch.expm1(normalizer / taus.double()))).flatten().float()
