"""Argument checks shared by every GLA variant, so all of them reject bad input the same way."""

from __future__ import annotations

import torch

from hyla.ops.attention import check_cu_seqlens


def check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens) -> tuple[int, float]:
    """Validate the GLA op contract; return (number of sequences N, scale).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; g <= 0; initial_state: [N, H, K, V];
    cu_seqlens: int tensor [N + 1], 0 ... T, non-decreasing, only with B == 1.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, T, H, D], got {shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} [B, T, H, K], "
                         f"got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the shape of q {tuple(q.shape)} [B, T, H, K], "
                         f"got {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V] to match q, "
                         f"got {tuple(v.shape)}")
    if not g.is_floating_point():
        raise ValueError(f"g must be a floating-point log forget gate, got dtype {g.dtype}")
    if g.numel() and bool((g > 0).any()):
        raise ValueError(f"g is a log forget gate and must be <= 0, got max {g.max().item():.4g}")
    if cu_seqlens is not None:
        N = len(check_cu_seqlens(cu_seqlens, B, T)) - 1
    else:
        N = B
    if initial_state is not None:
        expected = (N, H, K, v.shape[-1])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [N, H, K, V] = {list(expected)}, "
                             f"got {tuple(initial_state.shape)}")
    if scale is None:
        scale = K ** -0.5
    return N, float(scale)


def seq_offsets(B: int, T: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]


def resolve_gate(g, gk):
    """The log gate, passed as ``g`` (hyla) or ``gk`` (flash-linear-attention's name)."""
    if gk is not None:
        if g is not None:
            raise ValueError("pass the log gate once, as g or as gk (flash-linear-attention's "
                             "name), not both")
        return gk
    if g is None:
        raise ValueError("g (the log gate, [B, T, H, K]; gk= is accepted too) is required")
    return g


def check_inplace(inplace: bool, initial_state, *inputs) -> None:
    """``inplace=True`` writes the final state into ``initial_state``: it needs one, and no
    gradient may flow (an in-place write would corrupt autograd's saved tensors)."""
    if not inplace:
        return
    if initial_state is None:
        raise ValueError("inplace=True writes the final state into initial_state: "
                         "initial_state [N, H, K, V] is required")
    if torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (*inputs, initial_state)):
        raise ValueError("inplace=True is for inference: an input requires grad "
                         "(run under torch.no_grad(), or leave inplace=False)")


def write_back(initial_state, final, inplace: bool):
    """With ``inplace``, copy ``final`` into ``initial_state`` (unless it already is it) and
    return ``initial_state``; else return ``final``."""
    if not inplace or final is None:
        return final
    if final.data_ptr() != initial_state.data_ptr():
        with torch.no_grad():
            initial_state.copy_(final)
    return initial_state
