"""``D`` and ``K`` with ``linear_window > 0``: linearised softmax attention whose recurrent
branch is the gated delta rule (the distillation targets of Gated DeltaNet / KDA hybrids).

The layer of :mod:`hyla.model.mixers.linearised.gla` with another memory for what falls out of
the window. Shared (:class:`~hyla.model.mixers.linearised.LinearisedAttention`): the
teacher's q/k/v/o (grouped-query heads, biases, q/k norms), exact softmax over the last
``linear_window`` tokens and the first ``window_sinks`` with the teacher's rotary positions,
Hedgehog feature maps of q and k, and the learned per-token, per-head mix ``lam * window +
(1 - lam) * delta``. The branch:

- keys and queries are the Hedgehog features (positive, ``2 head_dim`` wide) L2-normalised,
  as the delta rule needs (its update ``S <- g (I - beta k k^T) S + beta k v^T`` is then a
  contraction, so the state never grows past the values it holds), read with scale 1: a
  query reads ``cos(q, k) v`` from a key it matches;
- ``beta = sigmoid(b_proj(x))`` a head, and a log decay ``logsigmoid(gk_proj(x)) /
  gate_logit_normalizer`` through a rank-``gate_low_rank_dim`` bottleneck, one a head
  (``D``) or one a feature channel (``K``, Kimi's per-channel gate);
- no output normaliser: with a contraction the output is already on the values' scale.

At the start keys are close to parallel (the identity feature maps of a head's keys are
alike), so the branch is a decayed moving average of the values: along the shared key
direction ``m <- g (1 - beta) m + beta v``. :meth:`calibrate` sets ``beta = 1 / d`` and the
decays' timescale ``4 d`` (per head; ``K``'s channels spread 16x either side), with ``d`` the
mean distance of the teacher's attention beyond the window, so the average spans about the
tokens the teacher reached for and its weights sum to ~0.8; the mix's bias is the share of
attention the window holds.

State, fixed whatever the context: the delta-rule matrix ``[H, 2D, D]`` float32 and the
window's and sinks' rotated keys and values, all in the :class:`StateSpec`. New parameters
(what distillation's stage 1 trains): the feature maps, ``gk_proj``, ``b_proj``, the mix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.mixers.base import StateSpec, TensorSpec
from hyla.model.mixers.deltanet import TIMESCALES, GatedDeltaMixer, KDAMixer
from hyla.model.mixers.gla import gate_bias
from hyla.model.mixers.linearised.base import LinearisedAttention
from hyla.ops.deltanet import chunk_gated_delta, delta_decode_step, l2norm

# How much longer than the far attention's mean distance the decays keep (calibrate).
DECAY_OVER_REACH = 4.0
BETA_RANGE = (0.01, 0.5)


class WindowedDeltaMixer(LinearisedAttention, GatedDeltaMixer):
    """What ``GatedDeltaMixer(cfg)`` builds when ``cfg.linear_window > 0`` (see the module
    doc); :class:`WindowedKDAMixer` is its ``K`` form.

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> cfg = dataclasses.replace(preset("debug"), linear_window=4, window_sinks=2)
        >>> layer = GatedDeltaMixer(cfg)
        >>> type(layer).__name__, layer(torch.randn(1, 9, 64), Context.train(
        ...     torch.zeros(1, 9, dtype=torch.long))).shape
        ('WindowedDeltaMixer', torch.Size([1, 9, 64]))
    """

    label = "windowed Gated DeltaNet"

    def __init__(self, cfg, layer_idx: int = 0):
        super(GatedDeltaMixer, self).__init__(cfg, layer_idx)    # not the D projections
        d, H, r = cfg.d_model, cfg.n_heads, cfg.gate_low_rank_dim
        self._build_attention(cfg)
        self.gk_proj = nn.Sequential(nn.Linear(d, r, bias=False),
                                     nn.Linear(r, H * self._decay_channels(cfg), bias=True))
        self.b_proj = nn.Linear(d, H)
        self.mix_proj = nn.Linear(d, H)                 # logit of the window's share
        self.reset_new_parameters()

    @classmethod
    def _decay_channels(cls, cfg) -> int:
        """Decays a head: one (``D``), or one a feature channel (``K``)."""
        return 2 * cfg.head_dim if cls.per_channel else 1

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        """Feature maps at identity, the window taking 90%, input-independent decays over 16
        ... 4,096 tokens (across heads for ``D``, across each head's channels for ``K``) and
        ``beta = 1 / linear_window`` (until :meth:`calibrate`)."""
        c = self.cfg
        self._reset_maps_and_mix()
        lo, hi = TIMESCALES
        n = self._decay_channels(c)
        tau = torch.logspace(math.log10(lo), math.log10(hi), n if n > 1 else c.n_heads,
                             dtype=torch.float64)
        taus = tau.repeat(c.n_heads, 1) if n > 1 else tau[:, None]
        self.gk_proj[1].weight.zero_()
        self.gk_proj[1].bias.copy_(gate_bias(taus, c.gate_logit_normalizer))
        self.b_proj.weight.zero_()
        self.b_proj.bias.fill_(math.log(1.0 / (c.linear_window - 1)) if c.linear_window > 1
                               else 0.0)           # logit(1 / window)

    # -- the protocol ------------------------------------------------------------------------
    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        H, D = cfg.n_heads, cfg.head_dim
        fixed = [TensorSpec("state", (H, 2 * D, D), torch.float32), *cls.window_specs(cfg)]
        return StateSpec(cls.kind, fixed=tuple(fixed))

    @classmethod
    def token_flops(cls, cfg) -> float:
        # S^T k, the rank-1 update and the readout (2 FLOPs a state entry each), the window
        H, D = cfg.n_heads, cfg.head_dim
        return 6 * H * (2 * D) * D + cls.window_flops(cfg)

    def new_parameters(self) -> list[nn.Parameter]:
        """What distillation's first stage trains: everything not taken from the teacher."""
        return [self.q_map, self.k_map, *self.gk_proj.parameters(), *self.b_proj.parameters(),
                *self.mix_proj.parameters()]

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> dict:
        """Set the mix, ``beta`` and the decays from the teacher's attention on a batch (see
        the module doc). q [B, T, H, D], k [B, T, H_kv, D]: the teacher's rotated queries
        and keys; positions [T]: each token's place in its document. Returns, per head, the
        window's share of attention, the far attention's mean distance and ``beta``."""
        share, dist = self.attention_reach(q, k, positions)
        c = self.cfg
        taus = DECAY_OVER_REACH * dist.double()[:, None]                     # [H, 1]
        n = self._decay_channels(c)
        if n > 1:
            spread = torch.logspace(-1.2, 1.2, n, dtype=torch.float64, device=q.device)
            taus = taus * spread[None]                                       # 1/16x ... 16x
        self.gk_proj[1].bias.copy_(gate_bias(taus, c.gate_logit_normalizer))
        beta = (1.0 / dist).clamp(*BETA_RANGE)
        self.b_proj.bias.copy_(torch.logit(beta).to(self.b_proj.bias))
        return {"window_share": share.tolist(), "far_distance": dist.tolist(),
                "beta": beta.tolist()}

    # -- the delta-rule branch ---------------------------------------------------------------
    def _linear(self, x, q, k, v, ctx) -> torch.Tensor:
        """The gated delta rule over L2-normalised feature maps: o [B, T, H, D]."""
        B, T, H, _ = q.shape
        c = self.cfg
        fq, fk, v = self._feature_maps(q, k, v)
        fq, fk = l2norm(fq), l2norm(fk)
        g = F.logsigmoid(self.gk_proj(x).float()) / c.gate_logit_normalizer
        g = g.view(B, T, H, -1) if self.per_channel else g.view(B, T, H)
        beta = torch.sigmoid(self.b_proj(x).float())
        if ctx.mode == "train":
            o, _ = chunk_gated_delta(fq, fk, v, g, beta, scale=1.0, cu_seqlens=ctx.cu_seqlens,
                                     chunk_size=c.chunk_size)
            return o
        buf = ctx.buffers[self.layer_idx]
        state = ctx.load_fixed(buf["state"])
        if ctx.mode == "prefill":
            o, state = chunk_gated_delta(fq, fk, v, g, beta, scale=1.0, initial_state=state,
                                         output_final_state=True, cu_seqlens=ctx.cu_seqlens,
                                         chunk_size=c.chunk_size)
        else:
            o = delta_decode_step(fq, fk, v, g, beta, state, scale=1.0)   # ``state`` in place
        ctx.store_fixed(buf["state"], state)
        return o


class WindowedKDAMixer(WindowedDeltaMixer, KDAMixer):
    """What ``KDAMixer(cfg)`` builds when ``cfg.linear_window > 0``: the windowed delta
    layer with one decay a feature channel.

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> cfg = dataclasses.replace(preset("debug"), linear_window=4, window_sinks=2)
        >>> layer = KDAMixer(cfg)
        >>> type(layer).__name__, layer.kind, layer.gk_proj[1].out_features
        ('WindowedKDAMixer', 'kda', 128)
    """

    label = "windowed KDA"


GatedDeltaMixer.windowed = WindowedDeltaMixer
KDAMixer.windowed = WindowedKDAMixer
