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

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm, apply_rotary
from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.base import StateSpec, TensorSpec
from hyla.model.mixers.gla import GLAMixer, gate_bias, slow_gate_bias
from hyla.ops.gla import chunk_gla, gla_decode_step
from hyla.ops.window_attention import sink_window_attention, visible


class WindowedGLAMixer(GLAMixer):
    """What ``GLAMixer(cfg)`` builds when ``cfg.linear_window > 0`` (see the module doc).

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
        d, D, H = cfg.d_model, cfg.head_dim, cfg.n_heads
        self.q_proj = nn.Linear(d, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, d, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(D, eps=cfg.norm_eps)
        eye = torch.eye(D).repeat(H, 1, 1)
        self.q_map = nn.Parameter(eye.clone())          # Hedgehog feature maps, [H, D, D]
        self.k_map = nn.Parameter(eye.clone())
        self.gk_proj = nn.Sequential(nn.Linear(d, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, H * 2 * D, bias=True))
        self.mix_proj = nn.Linear(d, H)                 # logit of the window's share
        self.reset_new_parameters()

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        """Feature maps at identity, input-independent gates forgetting over 16 ... 4,096
        tokens, the window taking 90% (until :meth:`calibrate`)."""
        H, D = self.cfg.n_heads, self.cfg.head_dim
        eye = torch.eye(D, device=self.q_map.device).repeat(H, 1, 1)
        self.q_map.copy_(eye)
        self.k_map.copy_(eye)
        self.gk_proj[1].weight.zero_()
        self.gk_proj[1].bias.copy_(slow_gate_bias(self.cfg, 2 * D))
        self.mix_proj.weight.zero_()
        self.mix_proj.bias.fill_(math.log(9.0))

    # -- the protocol ------------------------------------------------------------------------
    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        H, D, kv = cfg.n_heads, cfg.head_dim, (cfg.n_kv_heads, cfg.head_dim)
        fixed = [TensorSpec("state", (H, 2 * D, D + 1), torch.float32),
                 TensorSpec("window_keys", (cfg.linear_window, *kv)),
                 TensorSpec("window_values", (cfg.linear_window, *kv))]
        if cfg.window_sinks:
            fixed += [TensorSpec("sink_keys", (cfg.window_sinks, *kv)),
                      TensorSpec("sink_values", (cfg.window_sinks, *kv))]
        return StateSpec(cls.kind, fixed=tuple(fixed))

    @classmethod
    def token_flops(cls, cfg) -> float:
        H, D = cfg.n_heads, cfg.head_dim
        return 4 * H * (2 * D) * (D + 1) + 4 * H * D * (cfg.linear_window + cfg.window_sinks)

    def new_parameters(self) -> list[nn.Parameter]:
        """What distillation's first stage trains: everything not taken from the teacher."""
        return [self.q_map, self.k_map, *self.gk_proj.parameters(), *self.mix_proj.parameters()]

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """The teacher's q/k/v/o (and biases, q/k norms) as they are (with fewer KV heads, each
        the mean of its group, as the ``A`` mixer does); new parameters reset."""
        AttentionMixer.init_from_attention(self, teacher)      # the same names, merged alike
        self.reset_new_parameters()

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> dict:
        """Set the mix and the forget gates from the teacher's attention on a batch.

        q [B, T, H, D], k [B, T, H_kv, D]: the teacher's rotated queries and keys;
        positions [T]: each token's place in its document (packed documents do not see each
        other). Per head: the share of attention inside the window and sinks (the mix's
        bias: its logit) and the mean distance of the attention beyond them (the gates'
        middle timescale; the channels spread 16x either side). Returns both per head.
        """
        c = self.cfg
        B, T, H, D = q.shape
        kk = k.repeat_interleave(H // k.shape[2], 2).float()
        s = torch.einsum("bthd,bshd->bhts", q.float(), kk) * D ** -0.5
        t = torch.arange(T, device=q.device)
        i, j = t[:, None], t[None]
        start = (t - positions.to(q.device))[:, None]               # each query's document
        s = s.masked_fill((j > i) | (j < start), -math.inf)
        p = s.softmax(-1)
        inside = (i - j < c.linear_window) | (j - start < c.window_sinks)
        share = (p * inside).sum(-1).mean((0, 2)).clamp(0.05, 0.995)         # [H]
        far = p * ~inside
        dist = (far * (i - j)).sum((-1, -2)) / far.sum((-1, -2)).clamp_min(1e-9)
        dist = dist.mean(0).clamp(c.linear_window, 8 * T)                    # [H]
        self.mix_proj.bias.copy_(torch.logit(share).to(self.mix_proj.bias))
        spread = torch.logspace(-1.2, 1.2, 2 * D, dtype=torch.float64, device=q.device)
        taus = dist.double()[:, None] * spread[None]                        # 1/16x ... 16x
        self.gk_proj[1].bias.copy_(gate_bias(taus, c.gate_logit_normalizer))
        return {"window_share": share.tolist(), "far_distance": dist.tolist()}

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        H, D = c.n_heads, c.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, D)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, D)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        pos = ctx.positions if ctx.mode != "decode" else ctx.positions[:, None]
        lengths = AttentionMixer._rope_lengths(self, ctx)          # dynamic RoPE, as A does
        if lengths is not None and ctx.mode == "decode":
            lengths = lengths[:, None]
        qr = apply_rotary(q, pos, c.rope_theta, c.rope_scaling, lengths)
        kr = apply_rotary(k, pos, c.rope_theta, c.rope_scaling, lengths)
        fq, fk, vv, gk = self._linear_inputs(x, q, k, v)
        if ctx.mode == "train":
            o_win = sink_window_attention(qr, kr, v, ctx.positions, window=c.linear_window,
                                          sinks=c.window_sinks, cu_seqlens=ctx.cu_seqlens)
            o_lin, _ = chunk_gla(fq, fk, vv, gk, scale=1.0, cu_seqlens=ctx.cu_seqlens,
                                 chunk_size=c.chunk_size)
        else:
            buf = ctx.buffers[self.layer_idx]
            state = ctx.load_fixed(buf["state"])
            if ctx.mode == "prefill":
                o_win = self._window_chunks(qr, kr, v, ctx, buf)
                o_lin, state = chunk_gla(fq, fk, vv, gk, scale=1.0, initial_state=state,
                                         output_final_state=True, cu_seqlens=ctx.cu_seqlens,
                                         chunk_size=c.chunk_size)
            else:
                o_win = self._window_step(qr, kr, v, ctx, buf)
                o_lin = gla_decode_step(fq, fk, vv, gk, state, scale=1.0)
            ctx.store_fixed(buf["state"], state)
        o_lin = o_lin[..., :D] / (o_lin[..., D:].float() + 1e-6).to(o_lin.dtype)
        mix = torch.sigmoid(self.mix_proj(x).float()).to(x.dtype)[..., None]  # [B, T, H, 1]
        o = mix * o_win.to(x.dtype) + (1 - mix) * o_lin.to(x.dtype)
        return self.o_proj(o.reshape(B, T, H * D))

    def _linear_inputs(self, x, q, k, v):
        """Feature-mapped q, k [B, T, H, 2D], values with a ones column [B, T, H, D + 1] and
        log forget gates [B, T, H, 2D] of the GLA branch (no rotary: GLA has no positions)."""
        B, T, H, D = q.shape
        rep = H // k.shape[2]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        fq, fk = hedgehog(q, self.q_map), hedgehog(k, self.k_map)
        vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.cfg.gate_logit_normalizer
        return fq, fk, vv, gk.view(B, T, H, 2 * D)

    def _held_tokens(self, buf, rows, last: torch.Tensor):
        """The sinks and window a sequence holds before its next token at position
        ``last + 1``: keys, values [N, E, H_kv, D] and positions [N, E] (-1: empty)."""
        c = self.cfg
        W, S = c.linear_window, c.window_sinks
        slot = torch.arange(W, device=last.device)
        ring_pos = last[:, None] - torch.remainder(last[:, None] - slot[None], W)   # [N, W]
        ring_pos = torch.where(ring_pos >= S, ring_pos, -1)
        keys, values, pos = [buf["window_keys"][rows]], [buf["window_values"][rows]], [ring_pos]
        if S:
            a = torch.arange(S, device=last.device)[None]
            keys.insert(0, buf["sink_keys"][rows])
            values.insert(0, buf["sink_values"][rows])
            pos.insert(0, torch.where(a <= last[:, None], a, -1))
        return torch.cat(keys, 1), torch.cat(values, 1), torch.cat(pos, 1)

    def _window_chunks(self, q, k, v, ctx, buf) -> torch.Tensor:
        c = self.cfg
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            row = ctx.slots[j]
            sl = slice(s, s + n)
            pos = ctx.positions[sl]
            cache = self._held_tokens(buf, row[None], pos[:1] - 1) if start else None
            outs.append(sink_window_attention(q[:, sl], k[:, sl], v[:, sl], pos,
                                              window=c.linear_window, sinks=c.window_sinks,
                                              cache=cache))
            keep = slice(max(0, n - c.linear_window), n)      # only the last W reach the ring
            self._store(buf, row, k[0, sl][keep], v[0, sl][keep], pos[keep] % c.linear_window,
                        "window")
            first = pos < c.window_sinks
            if first.any():
                self._store(buf, row, k[0, sl][first], v[0, sl][first], pos[first], "sink")
            s += n
        return torch.cat(outs, 1)

    @staticmethod
    def _store(buf, rows, k, v, slots, name: str) -> None:
        buf[f"{name}_keys"][rows, slots] = k.to(buf[f"{name}_keys"].dtype)
        buf[f"{name}_values"][rows, slots] = v.to(buf[f"{name}_values"].dtype)

    def _window_step(self, q, k, v, ctx, buf) -> torch.Tensor:
        """Decode: each sequence's sinks + window + its new token, by masked SDPA (tensors
        only, so a compiled decode step has no graph break)."""
        c = self.cfg
        rows, P = ctx.slots, ctx.positions
        ck, cv, cp = self._held_tokens(buf, rows, P - 1)
        keys = torch.cat([ck.to(q.dtype), k], 1)                    # [B, E + 1, H_kv, D]
        values = torch.cat([cv.to(q.dtype), v], 1)
        kpos = torch.cat([cp, P[:, None]], 1)
        mask = visible(P[:, None], kpos, c.linear_window, c.window_sinks)      # [B, 1, E + 1]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask[:, None],
                                           enable_gqa=keys.shape[2] != q.shape[2])
        S = c.window_sinks
        self._store(buf, rows, k[:, 0], v[:, 0], P % c.linear_window, "window")
        if S:
            # every step writes a sink slot (tensors only); past the sinks, the slot it
            # rewrites is read back unchanged
            slot = P.clamp(max=S - 1)
            first = (P < S)[:, None, None]
            old_k, old_v = buf["sink_keys"][rows, slot], buf["sink_values"][rows, slot]
            buf["sink_keys"][rows, slot] = torch.where(first, k[:, 0].to(old_k.dtype), old_k)
            buf["sink_values"][rows, slot] = torch.where(first, v[:, 0].to(old_v.dtype), old_v)
        return o.transpose(1, 2)


def hedgehog(x: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """Hedgehog feature map (Zhang et al. 2024): x [B, T, H, D], maps [H, D, D] ->
    ``[softmax(x W), softmax(-x W)]`` [B, T, H, 2D], positive, each half summing to 1.

    Example:
        >>> f = hedgehog(torch.randn(1, 3, 2, 4), torch.eye(4).repeat(2, 1, 1))
        >>> f.shape, bool((f > 0).all()), torch.allclose(f.sum(-1), torch.full((1, 3, 2), 2.))
        (torch.Size([1, 3, 2, 8]), True, True)
    """
    z = torch.einsum("bthd,hde->bthe", x, maps.to(x.dtype)).float()
    return torch.cat([z.softmax(-1), (-z).softmax(-1)], -1).to(x.dtype)


GLAMixer.windowed = WindowedGLAMixer
