"""``attention_kl``: the public StreamKL op, dispatching to a backend; ``AttentionKLLoss``.

Backends: ``"chunk"`` (streaming PyTorch, any device), ``"naive"`` (materialised reference,
O(T S) memory), ``"triton"`` (fused kernels, :mod:`hyla.ops.streamkl.triton`; optional, needs
the ``triton`` package). ``backend=None`` picks ``"triton"`` for CUDA tensors when triton
imports, ``"chunk"`` otherwise.
"""

from __future__ import annotations

import functools
import importlib

import torch

from hyla.ops.streamkl.chunk import chunk_attention_kl
from hyla.ops.streamkl.naive import naive_attention_kl

BACKENDS = ("chunk", "naive", "triton")


@functools.cache
def _triton_backend():
    """The triton backend's function, or None when triton does not import. Imported lazily:
    importing triton costs about a second and CPU-only installs need not have it."""
    try:
        return importlib.import_module("hyla.ops.streamkl.triton").triton_attention_kl
    except ImportError:
        return None


def _default_backend(x: torch.Tensor) -> str:
    return "triton" if x.is_cuda and _triton_backend() is not None else "chunk"


def attention_kl(q_t, k_t, q_s, k_s, *, scale_t=None, scale_s=None, causal=True,
                 reduction="mean", cu_seqlens=None, backend=None, block_q=256, block_k=512):
    """KL(P_teacher || P_student) between two attention distributions, per query row.

    ``P = softmax(scale_t q_t k_t^T)`` and ``Q = softmax(scale_s q_s k_s^T)`` per (batch,
    query head, row); ``KL_i = sum_j P_ij log(P_ij / Q_ij)``. Teacher and student have the
    same query heads ``H``; each side's keys may have fewer heads dividing ``H`` (GQA: query
    head ``h`` reads key head ``h // (H // H_kv)``), and the two sides may differ in head dim
    and scale. Causal masking is bottom-right aligned when ``S != T``; rows that see no key
    have KL 0, gradient 0, and are left out of ``"mean"``.

    Args:
        q_t: [B, T, H, D_t], k_t: [B, S, H_kv_t, D_t]: the teacher's queries and keys.
        q_s: [B, T, H, D_s], k_s: [B, S, H_kv_s, D_s]: the student's. All four share one
            floating dtype (fp32, bf16, fp16, fp64) and one device.
        scale_t, scale_s: softmax scales, default D_t ** -0.5 and D_s ** -0.5.
        causal: query ``i`` sees keys ``0 ... S - T + i``.
        reduction: "none" -> [B, H, T]; "sum"; "mean" over valid rows.
        cu_seqlens: optional int [N + 1] offsets of packed documents (B == 1, S == T); no row
            sees a key of another document.
        backend: "chunk", "naive" or "triton"; None picks "triton" for CUDA tensors when
            triton imports, else "chunk". "triton" computes what its kernels do not support
            (cu_seqlens, fp64, non-CUDA tensors) with "chunk".
        block_q, block_k: tile sizes of the chunk backend (and of triton's fallback).
    Returns:
        The KL in float32 (float64 for float64 inputs). Gradients reach q_s, k_s and, when
        they require grad, q_t and k_t.

    Example:
        >>> q_t, k_t = torch.randn(2, 64, 4, 32), torch.randn(2, 64, 2, 32)
        >>> q_s = torch.randn(2, 64, 4, 16, requires_grad=True)
        >>> k_s = torch.randn(2, 64, 1, 16, requires_grad=True)
        >>> attention_kl(q_t, k_t, q_s, k_s).backward()
        >>> q_s.grad.shape
        torch.Size([2, 64, 4, 16])
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {backend!r}")
    name = backend
    if name is None:
        name = _default_backend(q_t) if isinstance(q_t, torch.Tensor) else "chunk"
    kw = {"scale_t": scale_t, "scale_s": scale_s, "causal": causal, "reduction": reduction,
          "cu_seqlens": cu_seqlens}
    if name == "naive":
        return naive_attention_kl(q_t, k_t, q_s, k_s, **kw)
    kw |= {"block_q": block_q, "block_k": block_k}
    if name == "chunk":
        return chunk_attention_kl(q_t, k_t, q_s, k_s, **kw)
    fn = _triton_backend()
    if fn is None:
        raise ValueError('backend="triton" needs the triton package: pip install "hyla[gpu]"')
    return fn(q_t, k_t, q_s, k_s, **kw)


class AttentionKLLoss(torch.nn.Module):
    """Attention-distillation loss: ``attention_kl`` with its options fixed at construction.

    Example:
        >>> loss_fn = AttentionKLLoss(causal=True, reduction="mean")
        >>> q, k = torch.randn(1, 32, 2, 8), torch.randn(1, 32, 2, 8)
        >>> float(loss_fn(q, k, q, k))
        0.0
    """

    def __init__(self, *, scale_t: float | None = None, scale_s: float | None = None,
                 causal: bool = True, reduction: str = "mean", backend: str | None = None,
                 block_q: int = 256, block_k: int = 512):
        super().__init__()
        self.kw = {"scale_t": scale_t, "scale_s": scale_s, "causal": causal,
                   "reduction": reduction, "backend": backend, "block_q": block_q,
                   "block_k": block_k}

    def forward(self, q_t, k_t, q_s, k_s, cu_seqlens=None) -> torch.Tensor:
        """q_t, k_t: the teacher's [B, T, H, D_t] / [B, S, H_kv_t, D_t]; q_s, k_s: the
        student's; returns the reduced KL (see :func:`attention_kl`)."""
        return attention_kl(q_t, k_t, q_s, k_s, cu_seqlens=cu_seqlens, **self.kw)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kw.items())
