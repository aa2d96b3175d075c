"""``A``: softmax attention with rotary positions and grouped-query heads.

State per sequence: its keys and values, one [n_kv_heads, head_dim] row each per token, in
the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm, apply_rotary
from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, merge_kv_heads, register_mixer
from hyla.ops.attention import attention, attention_with_cache, window_mask


@register_mixer("A")
class AttentionMixer(Mixer):
    """Causal softmax attention (``cfg.n_kv_heads`` key/value heads, Llama's rotary layout).

    What the transformers families need is configuration (:class:`~hyla.model.HylaConfig`):
    q/k/v biases (``attention_bias``) and an o bias (``attention_out_bias``), RMSNorm per
    head on q and k before rotary (``qk_norm``), a head dim of its own
    (``attention_head_dim``), scaled RoPE (``rope_scaling``) and a causal sliding window
    (``sliding_window``: training, prefill and decode alike; decode reads only the blocks
    the window covers).

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
        d, hd = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps)

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
        same for every head, so the merged rotated key is the rotated merged key (biases
        merge the same way; q/k norms are per head dim, shared by all heads)."""
        heads, new = teacher.cfg.n_kv_heads, self.cfg.n_kv_heads
        for name, tensor in teacher.state_dict().items():
            if name.startswith(("k_proj.", "v_proj.")) and heads != new:
                flat = tensor[:, None] if tensor.dim() == 1 else tensor
                tensor = merge_kv_heads(flat, heads, new).reshape(-1, *tensor.shape[1:])
            self.get_parameter(name).copy_(tensor)

    def _project(self, x: torch.Tensor, positions: torch.Tensor, lengths=None):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return (apply_rotary(q, positions, c.rope_theta, c.rope_scaling, lengths),
                apply_rotary(k, positions, c.rope_theta, c.rope_scaling, lengths), v)

    def _rope_lengths(self, ctx) -> torch.Tensor | None:
        """Dynamic RoPE rescales by the length a forward sees (transformers'
        ``max(position_ids) + 1``): the whole batch in training, each chunk's end in
        prefill, each token's own in decode. Other RoPE kinds do not need it."""
        scaling = self.cfg.rope_scaling
        if not scaling or scaling.get("rope_type") != "dynamic":
            return None
        pos = ctx.positions
        if ctx.mode == "train":
            return (pos.max() + 1).expand_as(pos)
        if ctx.mode == "prefill":
            ends = torch.tensor([s + n for s, n in zip(ctx.starts, ctx.lengths, strict=True)],
                                device=pos.device)
            return ends.repeat_interleave(torch.tensor(ctx.lengths, device=pos.device))
        return pos + 1

    def attention_qk(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self._project(x, ctx.positions, self._rope_lengths(ctx))
        return q, k

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.mode == "decode":
            return self._attend_step(x, ctx)
        q, k, v = self._project(x, ctx.positions, self._rope_lengths(ctx))
        if ctx.mode == "train":
            o = attention(q, k, v, causal=True, cu_seqlens=ctx.cu_seqlens,
                          window=self.cfg.sliding_window)
        else:
            o = self._attend_chunks(q, k, v, ctx)
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def _attend_chunks(self, q, k, v, ctx) -> torch.Tensor:
        buf = ctx.buffers[self.layer_idx]
        window = self.cfg.sliding_window
        ctx.append_rows(buf["keys"], k[0])
        ctx.append_rows(buf["values"], v[0])
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            qc = q[:, s:s + n]
            if start == 0:      # the chunk is all there is: attend to its fresh keys
                o = attention(qc, k[:, s:s + n], v[:, s:s + n], causal=True, window=window)
            else:
                # with a window, rows before the first query's window are never read (the
                # engine may have freed their blocks)
                first = 0 if window is None else max(0, start - window + 1)
                keys = ctx.sequence_rows(buf["keys"], j, start + n, first)[None].to(q.dtype)
                values = ctx.sequence_rows(buf["values"], j, start + n, first)[None].to(q.dtype)
                o = attention_with_cache(qc, keys, values, torch.tensor([start + n - first]),
                                         window=window)
            outs.append(o)
            s += n
        return torch.cat(outs, dim=1)

    def _attend_step(self, x, ctx) -> torch.Tensor:
        buf = ctx.buffers[self.layer_idx]
        positions = ctx.positions
        lengths = self._rope_lengths(ctx)
        q, k, v = self._project(x, positions[:, None],
                                None if lengths is None else lengths[:, None])
        ctx.append_rows(buf["keys"], k[:, 0])
        ctx.append_rows(buf["values"], v[:, 0])
        window = self.cfg.sliding_window
        if window is None:
            keys = ctx.batch_rows(buf["keys"]).to(q.dtype)      # [B, blocks * bs, Hkv, D]
            values = ctx.batch_rows(buf["values"]).to(q.dtype)
            key_pos = torch.arange(keys.shape[1], device=x.device)[None, :]
            mask = key_pos <= positions[:, None]
        else:
            keys, values, key_pos, valid = self._window_rows(buf, ctx)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            mask = valid & window_mask(positions[:, None], key_pos, window)[:, 0]
        # Inline masked SDPA: attention_with_cache's range checks would break a compiled graph.
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask[:, None, None],
                                           enable_gqa=keys.shape[2] != q.shape[2])
        return self.o_proj(o.transpose(1, 2).reshape(x.shape[0], 1, -1))

    def _window_rows(self, buf, ctx):
        """Decode with a sliding window: only the blocks the window covers, a fixed number a
        sequence (so the cost stays flat with context and freed blocks are never read).
        Returns keys, values [B, n * bs, Hkv, D], their positions and which are real rows."""
        bs, tables, positions = ctx.block_size, ctx.block_tables, ctx.positions
        n = min((self.cfg.sliding_window - 1) // bs + 2, tables.shape[1])
        raw = (positions // bs)[:, None] - n + 1 + torch.arange(n, device=positions.device)
        idx = raw.clamp(min=0)                                  # [B, n] block numbers
        blocks = tables.gather(1, idx)
        keys = buf["keys"][blocks].flatten(1, 2)
        values = buf["values"][blocks].flatten(1, 2)
        offsets = torch.arange(bs, device=positions.device)
        key_pos = (idx[:, :, None] * bs + offsets).flatten(1)                # [B, n * bs]
        valid = (raw >= 0)[:, :, None].expand(-1, -1, bs).flatten(1)
        return keys, values, key_pos, valid
