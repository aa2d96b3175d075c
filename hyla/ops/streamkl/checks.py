"""Argument checks and masking geometry shared by every StreamKL variant.

Head mapping (the contract): the KL is taken per (batch, query head, query row). Teacher and
student must have the same number of query heads ``H`` (query head ``h`` of the teacher is
compared with query head ``h`` of the student). Each side's keys may have fewer heads that
divide ``H`` (grouped-query attention), independently of the other side: query head ``h``
reads key head ``h // (H // H_kv)``, as in Llama and :mod:`hyla.ops.attention`.

Causal masking with ``S`` keys and ``T`` queries is bottom-right aligned (query ``i`` sits at
position ``S - T + i`` and sees keys ``0 ... S - T + i``), as in
:func:`hyla.ops.attention.attention_with_cache`; with ``S == T`` it is the usual lower
triangle. With ``S < T`` the first ``T - S`` rows see no key: they are *fully masked*, their
KL is 0 and they do not count in ``reduction="mean"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.ops.attention import check_cu_seqlens

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class KLProblem:
    """Validated shapes of one ``attention_kl`` call."""

    B: int
    T: int   # query rows
    S: int   # keys
    H: int   # query heads (both sides)
    H_kv_t: int
    H_kv_s: int
    scale_t: float
    scale_s: float
    causal: bool
    offsets: list[int] | None   # cu_seqlens as a list, or None

    def segments(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_end, k_start, k_end) of every independent block of the score matrix."""
        if self.offsets is None:
            return [(0, self.T, 0, self.S)]
        return [(s, e, s, e) for s, e in zip(self.offsets[:-1], self.offsets[1:], strict=True)
                if e > s]


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def check_kl_inputs(q_t, k_t, q_s, k_s, scale_t, scale_s, causal, reduction,
                    cu_seqlens) -> KLProblem:
    """Validate the ``attention_kl`` contract; raise ``ValueError`` naming the bad argument.

    q_t: [B, T, H, D_t], k_t: [B, S, H_kv_t, D_t], q_s: [B, T, H, D_s], k_s: [B, S, H_kv_s, D_s],
    H % H_kv_* == 0; one floating dtype and one device for all four; cu_seqlens (B == 1,
    S == T) an int tensor [N + 1] of offsets 0 ... T.
    """
    named = (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s))
    for name, x in named:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, H, D], got {_shape(x)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    dtypes = {name: x.dtype for name, x in named}
    if len(set(dtypes.values())) != 1:
        raise ValueError("q_t, k_t, q_s, k_s must share one dtype, got "
                         + ", ".join(f"{n}={str(d).removeprefix('torch.')}"
                                     for n, d in dtypes.items()))
    devices = {name: x.device for name, x in named}
    if len(set(devices.values())) != 1:
        raise ValueError("q_t, k_t, q_s, k_s must be on one device, got "
                         + ", ".join(f"{n}={d}" for n, d in devices.items()))
    B, T, H, D_t = q_t.shape
    if tuple(q_s.shape[:3]) != (B, T, H):
        raise ValueError(f"q_s must be [B, T, H, D_s] = [{B}, {T}, {H}, D_s] to match q_t "
                         f"{tuple(q_t.shape)}, got {tuple(q_s.shape)}")
    S = k_t.shape[1]
    for name, k, q in (("k_t", k_t, q_t), ("k_s", k_s, q_s)):
        if k.shape[0] != B or k.shape[1] != S or k.shape[3] != q.shape[3]:
            raise ValueError(f"{name} must be [B, S, H_kv, D] = [{B}, {S}, H_kv, {q.shape[3]}] "
                             f"to match q_{name[-1]} {tuple(q.shape)} and k_t "
                             f"{tuple(k_t.shape)}, got {tuple(k.shape)}")
        if k.shape[2] == 0 or H % k.shape[2]:
            raise ValueError(f"{name} heads must divide the query heads H={H} (grouped-query "
                             f"attention), got {name} {tuple(k.shape)} with H_kv={k.shape[2]}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    offsets = None
    if cu_seqlens is not None:
        if S != T:
            raise ValueError(f"cu_seqlens needs as many keys as queries, got k_t "
                             f"{tuple(k_t.shape)} for q_t {tuple(q_t.shape)}")
        offsets = check_cu_seqlens(cu_seqlens, B, T)
    scales = []
    for name, scale, D in (("scale_t", scale_t, D_t), ("scale_s", scale_s, q_s.shape[3])):
        value = D ** -0.5 if scale is None else float(scale)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
        scales.append(value)
    return KLProblem(B, T, S, H, k_t.shape[2], k_s.shape[2], scales[0], scales[1], bool(causal),
                     offsets)


def valid_rows(p: KLProblem, device=None) -> torch.Tensor:
    """[T] bool: rows that see at least one key (the same for every batch and head)."""
    rows = torch.arange(p.T, device=device)
    if p.causal:
        return rows + (p.S - p.T) >= 0
    return torch.full((p.T,), p.S > 0, dtype=torch.bool, device=device)


def reduce_kl(kl: torch.Tensor, p: KLProblem, reduction: str) -> torch.Tensor:
    """Apply ``reduction`` to per-row KL [B, H, T]; "mean" is over valid rows only (0 if none)."""
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    count = int(valid_rows(p).sum()) * p.B * p.H
    return total / max(count, 1)
