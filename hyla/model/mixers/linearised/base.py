"""What every linearised softmax-attention layer shares (``G``, ``D``, ``K`` with
``linear_window > 0``; LoLCATs, Liger), whatever its recurrent branch:

- the teacher's own q/k/v/o projections (grouped-query heads, biases, q/k norms);
- exact softmax attention, with the teacher's rotary positions, over the last
  ``linear_window`` tokens and the first ``window_sinks`` of the sequence, its keys and values
  held in a ring and a sink buffer of the :class:`StateSpec` in serving;
- Hedgehog feature maps of q and k for the recurrent branch (identity at first);
- a per-token, per-head mix ``lam * window + (1 - lam) * recurrent``: softmax attention's
  output is exactly ``lam* o_window + (1 - lam*) o_rest`` with ``lam*`` the share of
  attention the window holds, so ``lam`` is what a query gives the window;
- the teacher's attention statistics a layer calibrates from (that share, and the mean
  distance of the attention beyond the window).

:class:`LinearisedAttention` is a mixin: a layer class lists it before its recurrent mixer
(``class WindowedGLAMixer(LinearisedAttention, GLAMixer)``) and adds the recurrent branch
(``_linear``), its own new parameters, state entry and calibration.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm, rotate, shared_rotary_tables
from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.base import TensorSpec
from hyla.ops.window_attention import ring_positions, sink_window_attention, visible


class LinearisedAttention:
    """The teacher's attention, windowed, beside a recurrent branch (see the module doc).

    A subclass builds the shared parts with :meth:`_build_attention` and ``mix_proj``, defines
    ``_linear(x, q, k, v, ctx) -> o [B, T, H, D]`` (its branch, reading and writing its own
    state entries in prefill and decode) and ``reset_new_parameters``.
    """

    def _build_attention(self, cfg) -> None:
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
        # then the subclass's branch parameters, and ``mix_proj = nn.Linear(d_model, H)``:
        # the logit of the window's share (last, so its initialisation draws last)

    @torch.no_grad()
    def _reset_maps_and_mix(self) -> None:
        """Feature maps at identity, the window taking 90% (until ``calibrate``)."""
        H, D = self.cfg.n_heads, self.cfg.head_dim
        eye = torch.eye(D, device=self.q_map.device).repeat(H, 1, 1)
        self.q_map.copy_(eye)
        self.k_map.copy_(eye)
        self.mix_proj.weight.zero_()
        self.mix_proj.bias.fill_(math.log(9.0))

    @staticmethod
    def window_specs(cfg) -> list[TensorSpec]:
        """The window ring's and the sinks' rotated keys and values (model dtype)."""
        kv = (cfg.n_kv_heads, cfg.head_dim)
        specs = [TensorSpec("window_keys", (cfg.linear_window, *kv)),
                 TensorSpec("window_values", (cfg.linear_window, *kv))]
        if cfg.window_sinks:
            specs += [TensorSpec("sink_keys", (cfg.window_sinks, *kv)),
                      TensorSpec("sink_values", (cfg.window_sinks, *kv))]
        return specs

    @staticmethod
    def window_flops(cfg) -> float:
        return 4 * cfg.n_heads * cfg.head_dim * (cfg.linear_window + cfg.window_sinks)

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """The teacher's q/k/v/o (and biases, q/k norms) as they are (with fewer KV heads, each
        the mean of its group, as the ``A`` mixer does); new parameters reset."""
        AttentionMixer.init_from_attention(self, teacher)      # the same names, merged alike
        self.reset_new_parameters()

    @torch.no_grad()
    def attention_reach(self, q: torch.Tensor, k: torch.Tensor,
                        positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's attention on a batch, per head: (the share of attention inside the
        window and sinks, clamped to [0.05, 0.995]; the mean distance of the attention beyond
        them, clamped to [linear_window, 8 T]), both [H]; sets the mix's bias to the share's
        logit.

        q [B, T, H, D], k [B, T, H_kv, D]: the teacher's rotated queries and keys;
        positions [T]: each token's place in its document (packed documents do not see each
        other).
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
        return share, dist

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
        tables = shared_rotary_tables(ctx.memo, pos, D, c.rope_theta, c.rope_scaling, lengths,
                                      device=q.device)
        qr, kr = rotate(q, tables), rotate(k, tables)
        if ctx.mode == "train":
            o_win = sink_window_attention(qr, kr, v, ctx.positions, window=c.linear_window,
                                          sinks=c.window_sinks, cu_seqlens=ctx.cu_seqlens)
        elif ctx.mode == "prefill":
            o_win = self._window_chunks(qr, kr, v, ctx, ctx.buffers[self.layer_idx])
        else:
            o_win = self._window_step(qr, kr, v, ctx, ctx.buffers[self.layer_idx])
        o_lin = self._linear(x, q, k, v, ctx)
        mix = torch.sigmoid(self.mix_proj(x).float()).to(x.dtype)[..., None]  # [B, T, H, 1]
        o = torch.lerp(o_lin.to(x.dtype), o_win.to(x.dtype), mix)   # mix win + (1 - mix) lin
        return self.o_proj(o.reshape(B, T, H * D))

    def _feature_maps(self, q, k, v):
        """Hedgehog-mapped q, k [B, T, H, 2D] and values [B, T, H, D], key/value heads
        repeated for every query head (no rotary: the recurrent branch has no positions)."""
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        return hedgehog(q, self.q_map), hedgehog(k, self.k_map), v

    def _held_tokens(self, buf, rows, last: torch.Tensor):
        """The sinks and window a sequence holds before its next token at position
        ``last + 1``: keys, values [N, E, H_kv, D] and positions [N, E] (-1: empty)."""
        return (*self._held_rows(buf, rows), self._held_positions(last))

    def _held_rows(self, buf, rows):
        """Keys, values [N, E, H_kv, D] of the sinks and window: sinks first, then the ring.
        ``rows``: the sequences' slots (a tensor, or a slice of consecutive ones: views)."""
        if not self.cfg.window_sinks:
            return buf["window_keys"][rows], buf["window_values"][rows]
        return (torch.cat([buf["sink_keys"][rows], buf["window_keys"][rows]], 1),
                torch.cat([buf["sink_values"][rows], buf["window_values"][rows]], 1))

    def _held_positions(self, last: torch.Tensor) -> torch.Tensor:
        """The positions [N, E] of what :meth:`_held_rows` gives (-1: empty)."""
        c = self.cfg
        W, S = c.linear_window, c.window_sinks
        ring_pos = ring_positions(last, W)
        ring_pos = torch.where(ring_pos >= S, ring_pos, -1)
        if not S:
            return ring_pos
        a = torch.arange(S, device=last.device)[None]
        return torch.cat([torch.where(a <= last[:, None], a, -1), ring_pos], 1)

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
        ck, cv = self._held_rows(buf, rows if ctx.slot_span is None else ctx.slot_span)
        keys = torch.cat([ck.to(q.dtype), k], 1)                    # [B, E + 1, H_kv, D]
        values = torch.cat([cv.to(q.dtype), v], 1)
        # what each row may see depends on the positions only: one mask for every layer
        key = ("window mask", c.linear_window, c.window_sinks)
        mask = ctx.memo.get(key)
        if mask is None:
            kpos = torch.cat([self._held_positions(P - 1), P[:, None]], 1)
            mask = ctx.memo[key] = visible(P[:, None], kpos, c.linear_window,
                                           c.window_sinks)[:, None]    # [B, 1, 1, E + 1]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=keys.shape[2] != q.shape[2])
        S = c.window_sinks
        self._store(buf, rows, k[:, 0], v[:, 0], P % c.linear_window, "window")
        if S and self._some_in_sinks(ctx):
            # every step writes a sink slot (tensors only); past the sinks, the slot it
            # rewrites is read back unchanged
            slot = P.clamp(max=S - 1)
            first = (P < S)[:, None, None]
            old_k, old_v = buf["sink_keys"][rows, slot], buf["sink_values"][rows, slot]
            buf["sink_keys"][rows, slot] = torch.where(first, k[:, 0].to(old_k.dtype), old_k)
            buf["sink_values"][rows, slot] = torch.where(first, v[:, 0].to(old_v.dtype), old_v)
        return o.transpose(1, 2)

    def _some_in_sinks(self, ctx) -> bool:
        """Whether a sequence of this step is still filling its sinks. Eager, once a step
        for every layer (past the first tokens it saves each layer six ops); a compiled
        step keeps the tensor-only update instead (no data-dependent branch)."""
        if torch.compiler.is_compiling():
            return True
        key = ("in sinks", self.cfg.window_sinks)
        if key not in ctx.memo:
            ctx.memo[key] = bool((ctx.positions < self.cfg.window_sinks).any())
        return ctx.memo[key]


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
