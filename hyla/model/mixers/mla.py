"""``M``: multi-head latent attention (MLA, DeepSeek-V2), as Kimi Linear and Ring-2.5 ship it.

Keys and values come from one compressed latent a token: ``kv_a_proj_with_mqa`` maps the
input to ``kv_lora_rank`` latent numbers (RMS-normed by ``kv_a_layernorm``) plus one rotary
key of ``qk_rope_head_dim`` shared by every head; ``kv_b_proj`` expands the latent into each
head's position-free key part (``qk_nope_head_dim``) and its value (``v_head_dim``, which
may differ). Queries come from ``q_proj``, or through a low-rank bottleneck (``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``) when ``q_lora_rank`` is set. Each head's key is its nope
part followed by the shared rotary key; scores are scaled by ``(nope + rope) ** -0.5`` (times
yarn's ``mscale_all_dim`` correction squared, DeepSeek's rule).

Position: ``rope="interleaved"`` rotates the rope parts with DeepSeek's interleaved pairs
``(x0, x1), (x2, x3), ...`` (Ring-2.5, transformers' ``apply_rotary_pos_emb_interleave``:
the pairs are de-interleaved and rotated half-split, so the rotated parts come out
half-split, for queries and keys alike); ``"half"``: Llama's half-split layout; ``"none"``:
no rotation at all (Kimi Linear's MLA is NoPE: its "rope" key part is a plain shared key).
``output_gate``: Ring-2.5's head-wise gate, ``o_h * sigmoid(g_proj(x))_h`` before ``o_proj``.

State per sequence: the **compressed** latent and the rotated shared key, one row of
``kv_lora_rank + qk_rope_head_dim`` numbers a token in the model's dtype (what transformers
caches too), not the ``n_heads * (qk_head_dim + v_head_dim)`` numbers of expanded K and V.
Training and prefill expand the rows into keys and values (cheaper when many queries share
them); decode absorbs ``kv_b_proj`` into the query and the output instead, and attends to
the compressed rows directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm, apply_rotary
from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, register_mixer
from hyla.ops.attention import attention, attention_with_cache

ROPE_LAYOUTS = ("interleaved", "half", "none")


@dataclass(frozen=True)
class MLAOptions:
    """``cfg.mixer_options["mla"]`` (transformers' names, which are the same)."""

    kv_lora_rank: int                  # the cached latent's width
    qk_nope_head_dim: int              # per-head key part expanded from the latent
    qk_rope_head_dim: int              # the shared rotary key (cached beside the latent)
    v_head_dim: int                    # per-head value width
    q_lora_rank: int | None = None     # None: q_proj; else q_a_proj -> norm -> q_b_proj
    rope: str = "interleaved"          # "interleaved" (DeepSeek, Ring), "half", "none" (Kimi)
    output_gate: bool = False          # head-wise sigmoid gate g_proj (Ring-2.5)
    bias: bool = False                 # q_a_proj, kv_a_proj_with_mqa, o_proj biases
    latent_norm_eps: float = 1e-6      # eps of q_a_layernorm and kv_a_layernorm

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 0 (rotary pairs), "
                             f"got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be > 0 or None, got {self.q_lora_rank}")
        if self.rope not in ROPE_LAYOUTS:
            raise ValueError(f"rope must be one of {ROPE_LAYOUTS}, got {self.rope!r}")
        if not self.latent_norm_eps > 0:
            raise ValueError(f"latent_norm_eps must be > 0, got {self.latent_norm_eps}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def softmax_scale(cfg, o: MLAOptions) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled
    RoPE that sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``).

    Example:
        >>> o = MLAOptions(kv_lora_rank=8, qk_nope_head_dim=12, qk_rope_head_dim=4,
        ...                v_head_dim=8)
        >>> from types import SimpleNamespace as NS
        >>> softmax_scale(NS(rope_scaling=None), o)
        0.25
    """
    scale = o.qk_head_dim ** -0.5
    s = cfg.rope_scaling
    if o.rope != "none" and s and s.get("mscale_all_dim") and float(s["factor"]) > 1:
        m = 0.1 * float(s["mscale_all_dim"]) * math.log(float(s["factor"])) + 1.0
        scale *= m * m
    return scale


@register_mixer("M")
class MLAMixer(Mixer):
    """Multi-head latent attention over ``cfg.n_heads`` heads (options: :class:`MLAOptions`).

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> cfg = dataclasses.replace(preset("debug"), layers="GM", mixer_options={"mla": {
        ...     "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        ...     "v_head_dim": 12, "q_lora_rank": 24}})
        >>> layer = MLAMixer(cfg)
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
        >>> MLAMixer.state_spec(cfg).per_token_bytes(torch.bfloat16)   # (16 + 4) * 2
        40
    """

    kind = "mla"
    label = "MLA"
    state_label = "MLA latent"
    options_class = MLAOptions

    @classmethod
    def options(cls, cfg) -> MLAOptions:
        opts = super().options(cfg)
        if opts is None:
            raise ValueError("mixer_options['mla'] is required for an 'M' layer: kv_lora_rank, "
                             "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, ...")
        return opts

    @classmethod
    def check_config(cls, cfg) -> None:
        cls.options(cfg)
        if cfg.sliding_window is not None:
            raise ValueError(f"sliding_window={cfg.sliding_window} is not supported by an 'M' "
                             f"(MLA) layer: it attends to every cached token")

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        o, d, H = self.opts, cfg.d_model, cfg.n_heads
        if o.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * o.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, o.q_lora_rank, bias=o.bias)
            self.q_a_layernorm = RMSNorm(o.q_lora_rank, eps=o.latent_norm_eps)
            self.q_b_proj = nn.Linear(o.q_lora_rank, H * o.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, o.kv_lora_rank + o.qk_rope_head_dim, bias=o.bias)
        self.kv_a_layernorm = RMSNorm(o.kv_lora_rank, eps=o.latent_norm_eps)
        self.kv_b_proj = nn.Linear(o.kv_lora_rank, H * (o.qk_nope_head_dim + o.v_head_dim),
                                   bias=False)
        if o.output_gate:
            self.g_proj = nn.Linear(d, H, bias=False)
        self.o_proj = nn.Linear(H * o.v_head_dim, d, bias=o.bias)
        self.scale = softmax_scale(cfg, o)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        o = cls.options(cfg)
        return StateSpec(cls.kind, per_token=(TensorSpec("latent", (o.kv_lora_rank,)),
                                              TensorSpec("rope_key", (o.qk_rope_head_dim,))))

    @classmethod
    def pair_flops(cls, cfg) -> float:
        # QK^T and PV as prefill computes them (expanded keys and values); kv_b_proj is a
        # projection, counted with the parameters.
        o = cls.options(cfg)
        return 2 * cfg.n_heads * (o.qk_head_dim + o.v_head_dim)

    # -- the pieces -------------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, lengths) -> torch.Tensor:
        """Rotary on the rope part x [B, T, h, rope] (see the module docstring)."""
        rope = self.opts.rope
        if rope == "none" or x.shape[-1] == 0:
            return x
        if rope == "interleaved":
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        c = self.cfg
        return apply_rotary(x, positions, c.rope_theta, c.rope_scaling, lengths)

    def _project(self, x: torch.Tensor, positions: torch.Tensor, lengths=None):
        """x [B, T, d] -> queries [B, T, H, qk_head_dim] (rope part rotated), the normed
        latent [B, T, kv_lora_rank] and the rotated shared key [B, T, qk_rope_head_dim]."""
        B, T, _ = x.shape
        o, H = self.opts, self.cfg.n_heads
        if o.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, o.qk_head_dim)
        q_nope, q_rope = q.split([o.qk_nope_head_dim, o.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self._rotate(q_rope, positions, lengths)], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [o.kv_lora_rank, o.qk_rope_head_dim], dim=-1)
        k_rope = self._rotate(k_rope[:, :, None], positions, lengths)[:, :, 0]
        return q, self.kv_a_layernorm(latent), k_rope

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """Cached rows -> keys [B, S, H, qk_head_dim] and values [B, S, H, v_head_dim]:
        latent [B, S, kv_lora_rank], k_rope [B, S, qk_rope_head_dim]."""
        B, S, _ = latent.shape
        o, H = self.opts, self.cfg.n_heads
        kv = self.kv_b_proj(latent).view(B, S, H, o.qk_nope_head_dim + o.v_head_dim)
        k_nope, v = kv.split([o.qk_nope_head_dim, o.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].to(k_nope.dtype).expand(-1, -1, H, -1)], -1)
        return k, v

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.opts.output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float()).to(o.dtype)[..., None]
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def _lengths(self, ctx):
        return AttentionMixer._rope_lengths(self, ctx)          # dynamic RoPE, as A does

    def attention_qk(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        q, latent, k_rope = self._project(x, ctx.positions, self._lengths(ctx))
        return q, self.expand(latent, k_rope)[0]

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.mode == "decode":
            return self._attend_step(x, ctx)
        q, latent, k_rope = self._project(x, ctx.positions, self._lengths(ctx))
        if ctx.mode == "train":
            k, v = self.expand(latent, k_rope)
            o = attention(q, k, v, scale=self.scale, causal=True, cu_seqlens=ctx.cu_seqlens)
            return self._out(o, x)
        buf = ctx.buffers[self.layer_idx]
        ctx.append_rows(buf["latent"], latent[0])
        ctx.append_rows(buf["rope_key"], k_rope[0])
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            qc = q[:, s:s + n]
            if start == 0:      # the chunk is all there is: its fresh rows, as in training
                k, v = self.expand(latent[:, s:s + n], k_rope[:, s:s + n])
                o = attention(qc, k, v, scale=self.scale, causal=True)
            else:               # the cached rows (in the cache's dtype, as decode reads them)
                rows = ctx.sequence_rows(buf["latent"], j, start + n)[None].to(q.dtype)
                keys = ctx.sequence_rows(buf["rope_key"], j, start + n)[None].to(q.dtype)
                k, v = self.expand(rows, keys)
                o = attention_with_cache(qc, k, v, torch.tensor([start + n]), scale=self.scale)
            outs.append(o)
            s += n
        return self._out(torch.cat(outs, dim=1), x)

    def _attend_step(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """Decode, with ``kv_b_proj`` absorbed: each head's nope query is mapped into the
        latent space (``q_nope @ W_uk``) and attends to the cached rows themselves, one
        shared "key head" of ``kv_lora_rank + qk_rope_head_dim``; the attended latent then
        maps to the head's value (``@ W_uv``). Per step that reads the compressed rows once
        instead of expanding every cached token into H keys and values (the same product,
        reassociated)."""
        buf = ctx.buffers[self.layer_idx]
        positions = ctx.positions
        lengths = self._lengths(ctx)
        q, latent, k_rope = self._project(x, positions[:, None],
                                          None if lengths is None else lengths[:, None])
        ctx.append_rows(buf["latent"], latent[:, 0])
        ctx.append_rows(buf["rope_key"], k_rope[:, 0])
        o, H = self.opts, self.cfg.n_heads
        w = self.kv_b_proj.weight.view(H, o.qk_nope_head_dim + o.v_head_dim, o.kv_lora_rank)
        w_uk, w_uv = w.split([o.qk_nope_head_dim, o.v_head_dim], dim=1)
        q_nope, q_rope = q[:, 0].split([o.qk_nope_head_dim, o.qk_rope_head_dim], dim=-1)
        query = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_rope], dim=-1)
        rows = torch.cat([ctx.batch_rows(buf["latent"]), ctx.batch_rows(buf["rope_key"])],
                         dim=-1).to(q.dtype)                    # [B, blocks * bs, r + rope]
        mask = torch.arange(rows.shape[1], device=x.device)[None, :] <= positions[:, None]
        # Inline masked SDPA (as A's decode): no range checks to break a compiled graph.
        att = F.scaled_dot_product_attention(
            query[:, :, None], rows[:, None], rows[:, None, :, :o.kv_lora_rank],
            attn_mask=mask[:, None, None], scale=self.scale, enable_gqa=True)
        out = torch.einsum("bhr,hvr->bhv", att[:, :, 0], w_uv)
        return self._out(out[:, None], x)
