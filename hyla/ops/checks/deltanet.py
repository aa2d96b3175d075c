"""Argument checks and small helpers shared by every gated-delta variant."""

from __future__ import annotations

import torch

from hyla.ops.attention import check_cu_seqlens


def check_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens
                       ) -> tuple[int, float]:
    """Validate the gated-delta op contract; return (number of sequences N, scale).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] (one log decay a head) or
    [B, T, H, K] (one a key channel), <= 0; beta: [B, T, H]; initial_state: [N, H, K, V];
    cu_seqlens: int tensor [N + 1], 0 ... T, non-decreasing, only with B == 1.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, H, D], got {_shape(x)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} [B, T, H, K], "
                         f"got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V] to match q, "
                         f"got {tuple(v.shape)}")
    if not isinstance(g, torch.Tensor) or tuple(g.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g must be the log decay [B, T, H] = {[B, T, H]} (per head) or "
                         f"[B, T, H, K] = {[B, T, H, K]} (per key channel), got {_shape(g)}")
    if not g.is_floating_point():
        raise ValueError(f"g must be a floating-point log decay, got dtype {g.dtype}")
    if g.numel() and bool((g > 0).any()):
        raise ValueError(f"g is a log decay and must be <= 0, got max {g.max().item():.4g}")
    if not isinstance(beta, torch.Tensor) or tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {[B, T, H]}, got {_shape(beta)}")
    if not beta.is_floating_point():
        raise ValueError(f"beta must be floating point in (0, 1), got dtype {beta.dtype}")
    N = len(check_cu_seqlens(cu_seqlens, B, T)) - 1 if cu_seqlens is not None else B
    if initial_state is not None:
        expected = (N, H, K, v.shape[-1])
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [N, H, K, V] = {list(expected)}, "
                             f"got {_shape(initial_state)}")
    return N, float(K ** -0.5 if scale is None else scale)


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def state_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (so gradcheck works), else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) \
        else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (float64 for float64 x).

    Not rounded back to a 16-bit input dtype: the ops compute in float32 anyway, and
    rounding the normalised keys would add an error that the delta rule carries along.

    Example:
        >>> [round(x, 4) for x in l2norm(torch.tensor([3.0, 4.0])).tolist()]
        [0.6, 0.8]
    """
    xf = x if x.dtype == torch.float64 else x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def pop_aliases(kwargs: dict, use_qk_l2norm: bool) -> bool:
    """Accept flash-linear-attention's keyword ``use_qk_l2norm_in_kernel``; refuse others."""
    use = bool(kwargs.pop("use_qk_l2norm_in_kernel", use_qk_l2norm))
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return use


def resolve_decay(g, gk):
    """The log decay, as ``g`` ([B, T, H] or [B, T, H, K]) or as flash-linear-attention's
    per-key-channel ``gk`` ([B, T, H, K])."""
    if gk is None:
        if g is None:
            raise ValueError("g (the log decay, [B, T, H] or [B, T, H, K]; gk= for a decay a "
                             "key channel) is required")
        return g
    if g is not None:
        raise ValueError("pass the log decay once, as g or as gk, not both")
    if not isinstance(gk, torch.Tensor) or gk.dim() != 4:
        raise ValueError(f"gk is a decay per key channel, [B, T, H, K], got {_shape(gk)}")
    return gk


def seq_offsets(B: int, T: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]
