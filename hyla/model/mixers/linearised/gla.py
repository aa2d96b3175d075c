"""``G`` with ``linear_window > 0``: a linearised softmax-attention layer (LoLCATs, Liger).

A distillation student's linear layer that keeps what its teacher knew:

- the teacher's own q/k/v/o projections (grouped-query heads, biases, q/k norms), so the
  student starts from the teacher's weights and has its parameter count (+ ~2%);
- exact softmax attention, with the teacher's rotary positions, over the last
  ``linear_window`` tokens and the first ``window_sinks`` of the sequence
  (:func:`hyla.ops.window_attention.sink_window_attention`);
- a GLA branch over Hedgehog feature maps (``phi(x) = [softmax(x W), softmax(-x W)]``, one
  learnable ``W`` a head for q and for k, identity at first) with per-channel forget gates,
  normalised by the same recurrence run on a column of ones, so its output is a decayed
  average of values, as attention's is;
- a per-token, per-head mix ``lam * window + (1 - lam) * linear``: softmax attention's output
  is exactly ``lam* o_window + (1 - lam*) o_rest`` with ``lam*`` the share of attention the
  window holds, so ``lam`` is what a query gives the window and the linear branch stands for
  the rest.

Its state is fixed-size whatever the context: the GLA matrix ``[H, 2D, D + 1]`` float32 and the
window's and sinks' rotated keys and values (``[window + sinks, H_kv, D]`` each, in the model's
dtype), all in the :class:`StateSpec`, so the engine, prefix cache, transfer and ``hyla
memory`` carry them like any state. New parameters (what stage 1 of distillation trains):
the feature maps, the gates' low-rank projection and the mix; :meth:`calibrate` sets the mix
and the forget-gate timescales from the teacher's attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.mixers.base import StateSpec, TensorSpec
from hyla.model.mixers.gla import GLAMixer, gate_bias, slow_gate_bias
from hyla.model.mixers.linearised.base import LinearisedAttention, hedgehog
from hyla.ops.gla import chunk_gla, gla_decode_step

__all__ = ["WindowedGLAMixer", "hedgehog"]


class WindowedGLAMixer(LinearisedAttention, GLAMixer):
    """What ``GLAMixer(cfg)`` builds when ``cfg.linear_window > 0`` (see the module doc; the
    window, feature maps and mix are :class:`LinearisedAttention`'s).

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> cfg = dataclasses.replace(preset("debug"), linear_window=4, window_sinks=2)
        >>> layer = GLAMixer(cfg)
        >>> type(layer).__name__, layer(torch.randn(1, 9, 64), Context.train(
        ...     torch.zeros(1, 9, dtype=torch.long))).shape
        ('WindowedGLAMixer', torch.Size([1, 9, 64]))
    """

    label = "windowed GLA"

    def __init__(self, cfg, layer_idx: int = 0):
        super(GLAMixer, self).__init__(cfg, layer_idx)     # not GLAMixer's projections
        D, H = cfg.head_dim, cfg.n_heads
        self._build_attention(cfg)
        self.gk_proj = nn.Sequential(nn.Linear(cfg.d_model, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, H * 2 * D, bias=True))
        self.mix_proj = nn.Linear(cfg.d_model, H)       # logit of the window's share
        self.reset_new_parameters()

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        """Feature maps at identity, input-independent gates forgetting over 16 ... 4,096
        tokens, the window taking 90% (until :meth:`calibrate`)."""
        self._reset_maps_and_mix()
        self.gk_proj[1].weight.zero_()
        self.gk_proj[1].bias.copy_(slow_gate_bias(self.cfg, 2 * self.cfg.head_dim))

    # -- the protocol ------------------------------------------------------------------------
    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        H, D = cfg.n_heads, cfg.head_dim
        fixed = [TensorSpec("state", (H, 2 * D, D + 1), torch.float32),
                 *cls.window_specs(cfg)]
        return StateSpec(cls.kind, fixed=tuple(fixed))

    @classmethod
    def token_flops(cls, cfg) -> float:
        H, D = cfg.n_heads, cfg.head_dim
        return 4 * H * (2 * D) * (D + 1) + cls.window_flops(cfg)

    def new_parameters(self) -> list[nn.Parameter]:
        """What distillation's first stage trains: everything not taken from the teacher."""
        return [self.q_map, self.k_map, *self.gk_proj.parameters(), *self.mix_proj.parameters()]

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> dict:
        """Set the mix and the forget gates from the teacher's attention on a batch.

        q [B, T, H, D], k [B, T, H_kv, D]: the teacher's rotated queries and keys;
        positions [T]: each token's place in its document (packed documents do not see each
        other). Per head: the share of attention inside the window and sinks (the mix's
        bias: its logit) and the mean distance of the attention beyond them (the gates'
        middle timescale; the channels spread 16x either side). Returns both per head.
        """
        share, dist = self.attention_reach(q, k, positions)
        D = q.shape[-1]
        spread = torch.logspace(-1.2, 1.2, 2 * D, dtype=torch.float64, device=q.device)
        taus = dist.double()[:, None] * spread[None]                        # 1/16x ... 16x
        self.gk_proj[1].bias.copy_(gate_bias(taus, self.cfg.gate_logit_normalizer))
        return {"window_share": share.tolist(), "far_distance": dist.tolist()}

    # -- the GLA branch ----------------------------------------------------------------------
    def _linear(self, x, q, k, v, ctx) -> torch.Tensor:
        """The normalised GLA branch: o [B, T, H, D], a decayed average of values."""
        c = self.cfg
        D = c.head_dim
        fq, fk, vv, gk = self._linear_inputs(x, q, k, v)
        if ctx.mode == "train":
            o, _ = chunk_gla(fq, fk, vv, gk, scale=1.0, cu_seqlens=ctx.cu_seqlens,
                             chunk_size=c.chunk_size)
        else:
            buf = ctx.buffers[self.layer_idx]
            state = ctx.load_fixed(buf["state"])
            if ctx.mode == "prefill":
                o, state = chunk_gla(fq, fk, vv, gk, scale=1.0, initial_state=state,
                                     output_final_state=True, cu_seqlens=ctx.cu_seqlens,
                                     chunk_size=c.chunk_size)
            else:
                o = gla_decode_step(fq, fk, vv, gk, state, scale=1.0)
            ctx.store_fixed(buf["state"], state)
        return o[..., :D] / (o[..., D:].float() + 1e-6).to(o.dtype)

    def _linear_inputs(self, x, q, k, v):
        """Feature-mapped q, k [B, T, H, 2D], values with a ones column [B, T, H, D + 1] and
        log forget gates [B, T, H, 2D] of the GLA branch (no rotary: GLA has no positions)."""
        B, T, H, D = q.shape
        fq, fk, v = self._feature_maps(q, k, v)
        vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.cfg.gate_logit_normalizer
        return fq, fk, vv, gk.view(B, T, H, 2 * D)


GLAMixer.windowed = WindowedGLAMixer
