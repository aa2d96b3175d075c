"""``A``: softmax attention with rotary positions and grouped-query heads.

State per sequence: its keys and values, one [n_kv_heads, head_dim] row each per token, in
the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import apply_rotary
from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, merge_kv_heads, register_mixer
from hyla.ops.attention import attention, attention_with_cache


@register_mixer("A")
class AttentionMixer(Mixer):
    """Causal softmax attention (``cfg.n_kv_heads`` key/value heads, Llama's rotary layout).

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = AttentionMixer(preset("debug"))
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
    """

    kind = "attention"
    state_label = "attention KV"

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        d = cfg.d_model
        self.q_proj = nn.Linear(d, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, d, bias=False)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        row = (cfg.n_kv_heads, cfg.head_dim)
        return StateSpec(cls.kind, per_token=(TensorSpec("keys", row), TensorSpec("values", row)))

    @classmethod
    def pair_flops(cls, cfg) -> float:
        return 4 * cfg.n_heads * cfg.head_dim                          # QK^T and PV

    @classmethod
    def copies_attention(cls, teacher_cfg, cfg) -> bool:
        return cfg.n_kv_heads == teacher_cfg.n_kv_heads

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """Copy the teacher's attention. With fewer KV heads (KV-cache compression) each KV
        head is the mean of the group of teacher KV heads it replaces: query head ``h`` read
        teacher KV head ``h // (H / H_kv)``, which falls in group ``h // (H / H_s)``, so every
        query keeps reading a merge of the head it used to read. Rotary is linear and the
        same for every head, so the merged rotated key is the rotated merged key."""
        heads, new = teacher.cfg.n_kv_heads, self.cfg.n_kv_heads
        self.q_proj.weight.copy_(teacher.q_proj.weight)
        self.o_proj.weight.copy_(teacher.o_proj.weight)
        self.k_proj.weight.copy_(merge_kv_heads(teacher.k_proj.weight, heads, new))
        self.v_proj.weight.copy_(merge_kv_heads(teacher.v_proj.weight, heads, new))

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        return apply_rotary(q, positions, c.rope_theta), apply_rotary(k, positions, c.rope_theta), v

    def attention_qk(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self._project(x, ctx.positions)
        return q, k

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.mode == "decode":
            return self._attend_step(x, ctx)
        q, k, v = self._project(x, ctx.positions)
        if ctx.mode == "train":
            o = attention(q, k, v, causal=True, cu_seqlens=ctx.cu_seqlens)
        else:
            o = self._attend_chunks(q, k, v, ctx)
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def _attend_chunks(self, q, k, v, ctx) -> torch.Tensor:
        buf = ctx.buffers[self.layer_idx]
        ctx.append_rows(buf["keys"], k[0])
        ctx.append_rows(buf["values"], v[0])
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            qc = q[:, s:s + n]
            if start == 0:      # the chunk is all there is: attend to its fresh keys
                o = attention(qc, k[:, s:s + n], v[:, s:s + n], causal=True)
            else:
                keys = ctx.sequence_rows(buf["keys"], j, start + n)[None].to(q.dtype)
                values = ctx.sequence_rows(buf["values"], j, start + n)[None].to(q.dtype)
                o = attention_with_cache(qc, keys, values, torch.tensor([start + n]))
            outs.append(o)
            s += n
        return torch.cat(outs, dim=1)

    def _attend_step(self, x, ctx) -> torch.Tensor:
        buf = ctx.buffers[self.layer_idx]
        positions = ctx.positions
        q, k, v = self._project(x, positions[:, None])
        ctx.append_rows(buf["keys"], k[:, 0])
        ctx.append_rows(buf["values"], v[:, 0])
        keys = ctx.batch_rows(buf["keys"]).to(q.dtype)          # [B, blocks * bs, Hkv, D]
        values = ctx.batch_rows(buf["values"]).to(q.dtype)
        # Inline masked SDPA: attention_with_cache's range checks would break a compiled graph.
        mask = torch.arange(keys.shape[1], device=x.device)[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask[:, None, None],
                                           enable_gqa=keys.shape[2] != q.shape[2])
        return self.o_proj(o.transpose(1, 2).reshape(x.shape[0], 1, -1))
