"""Building blocks: RMSNorm, SwiGLU, rotary embedding, the GLA layer and the attention layer.

The two mixers share a calling convention so the model can treat them alike:
``forward(x, ...) -> y`` for training, plus ``prefill`` / ``decode`` variants that take and
return the layer's slice of a :class:`hyla.model.state.SequenceState`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import HylaConfig
from hyla.ops.attention import attention, attention_with_cache
from hyla.ops.gla import chunk_gla, recurrent_gla


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32.

    Example:
        >>> RMSNorm(8)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); [..., d_model] -> [..., d_model]."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by absolute ``positions`` [B, T] or [T] (half-split layout).

    The half-split ("rotate_half") layout is Llama's / Hugging Face's, so weights port as is.
    Frequencies are computed on the fly in float32: no buffer to move between devices or to
    materialise after construction on the meta device.

    Example:
        >>> x = torch.randn(1, 5, 2, 8)
        >>> torch.allclose(apply_rotary(x, torch.zeros(5, dtype=torch.long), 1e4), x)
        True
    """
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.to(x.device, torch.float32)[..., None] * inv_freq     # [(B,) T, D/2]
    angles = angles.reshape(-1 if positions.dim() == 2 else 1, x.shape[1], 1, D // 2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class GLALayer(nn.Module):
    """Gated linear attention (Yang et al. 2024), as flash-linear-attention's layer.

    q, k: d_model -> key_dim; v: d_model -> value_dim; log forget gate
    ``gk = logsigmoid(W2 W1 x + b) / gate_logit_normalizer`` through a rank-16 bottleneck;
    output ``o_proj(rmsnorm_per_head(o) * swish(g_proj(x)))``. State per sequence:
    [n_heads, head_k_dim, head_v_dim] float32.

    Example:
        >>> from hyla.model.config import preset
        >>> layer = GLALayer(preset("debug"))
        >>> layer(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(self, cfg: HylaConfig):
        super().__init__()
        self.cfg = cfg
        d, kd, vd = cfg.d_model, cfg.key_dim, cfg.value_dim
        self.q_proj = nn.Linear(d, kd, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, kd, bias=True))
        self.g_proj = nn.Linear(d, vd, bias=False)
        self.g_norm = RMSNorm(cfg.head_v_dim, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(vd, d, bias=False)

    def _qkvg(self, x):
        B, T, _ = x.shape
        H, K, V = self.cfg.n_heads, self.cfg.head_k_dim, self.cfg.head_v_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.cfg.gate_logit_normalizer
        return q, k, v, gk.view(B, T, H, K)

    def _out(self, x, o):
        B, T, _ = x.shape
        o = self.g_norm(o) * F.silu(self.g_proj(x).view_as(o))
        return self.o_proj(o.reshape(B, T, self.cfg.value_dim))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Training form: x [B, T, d_model] -> [B, T, d_model], state reset per document."""
        q, k, v, gk = self._qkvg(x)
        o, _ = chunk_gla(q, k, v, gk, cu_seqlens=cu_seqlens, chunk_size=self.cfg.chunk_size)
        return self._out(x, o)

    def prefill(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, d_model], state [H, K, V] fp32 -> (y [1, T, d_model], new state [H, K, V])."""
        q, k, v, gk = self._qkvg(x)
        o, final = chunk_gla(q, k, v, gk, initial_state=state[None], output_final_state=True,
                             chunk_size=self.cfg.chunk_size)
        return self._out(x, o), final[0]

    def decode(self, x: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, 1, d_model], states [B, H, K, V] fp32 -> (y [B, 1, d], new states).

        The new states may be ``states`` itself, updated in place (recurrent_gla's fast path).
        """
        q, k, v, gk = self._qkvg(x)
        o, final = recurrent_gla(q, k, v, gk, initial_state=states, output_final_state=True)
        return self._out(x, o), final


class AttentionLayer(nn.Module):
    """Softmax attention with rotary positions and grouped-query heads (cfg.n_kv_heads).

    Example:
        >>> from hyla.model.config import preset
        >>> layer = AttentionLayer(preset("debug"))
        >>> layer(torch.randn(2, 5, 64), torch.arange(5)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(self, cfg: HylaConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.q_proj = nn.Linear(d, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, d, bias=False)

    def _qkv(self, x, positions):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        return apply_rotary(q, positions, c.rope_theta), apply_rotary(k, positions, c.rope_theta), v

    def _out(self, o):
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Training form: x [B, T, d_model], positions [T] or [B, T] -> [B, T, d_model]."""
        q, k, v = self._qkv(x, positions)
        return self._out(attention(q, k, v, causal=True, cu_seqlens=cu_seqlens))

    def prefill(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Extend one sequence: x [1, T, d], caches [S, H_kv, D] -> (y, keys, values [S+T])."""
        S, T = k_cache.shape[0], x.shape[1]
        q, k, v = self._qkv(x, torch.arange(S, S + T, device=x.device))
        keys = torch.cat([k_cache, k[0].to(k_cache.dtype)])
        values = torch.cat([v_cache, v[0].to(v_cache.dtype)])
        if S == 0:
            o = attention(q, k, v, causal=True)
        else:
            o = attention_with_cache(q, keys[None].to(q.dtype), values[None].to(q.dtype),
                                     torch.tensor([S + T]))
        return self._out(o), keys, values

    def decode(self, x: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One token for each of B sequences with caches of different lengths.

        x [B, 1, d]; k_caches/v_caches: B tensors [S_b, H_kv, D]. Returns y [B, 1, d] and the
        extended caches [S_b + 1, H_kv, D]. Caches are right-padded into one batch.
        """
        B = x.shape[0]
        lens = torch.tensor([c.shape[0] for c in k_caches], device=x.device)
        q, k, v = self._qkv(x, lens[:, None])
        S = int(lens.max()) + 1
        shape = (B, S, self.cfg.n_kv_heads, self.cfg.head_dim)
        keys, values = q.new_zeros(shape), q.new_zeros(shape)
        new_k, new_v = [], []
        for b, (kc, vc) in enumerate(zip(k_caches, v_caches, strict=True)):
            n = kc.shape[0]
            keys[b, :n], keys[b, n] = kc, k[b, 0]
            values[b, :n], values[b, n] = vc, v[b, 0]
            new_k.append(torch.cat([kc, k[b].to(kc.dtype)]))
            new_v.append(torch.cat([vc, v[b].to(vc.dtype)]))
        o = attention_with_cache(q, keys, values, lens + 1)
        return self._out(o), new_k, new_v
