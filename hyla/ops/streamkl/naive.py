"""The specification of StreamKL: both attention distributions materialised, in float32.

    P = softmax(scale_t q_t k_t^T),  Q = softmax(scale_s q_s k_s^T)   (masked, per head)
    KL_i = sum_j P_ij (log P_ij - log Q_ij)

Memory is O(B H T S): this is the reference the streaming forms are checked against, and the
baseline the benchmark measures them against, not something to train with.
"""

from __future__ import annotations

import torch

from hyla.ops.streamkl.checks import check_kl_inputs, reduce_kl, valid_rows


def key_mask(p, device) -> torch.Tensor:
    """[T, S] bool: which keys each query row may see (causal and/or packed documents)."""
    rows = torch.arange(p.T, device=device)[:, None]
    cols = torch.arange(p.S, device=device)[None, :]
    mask = torch.ones(p.T, p.S, dtype=torch.bool, device=device)
    if p.causal:
        mask &= cols <= rows + (p.S - p.T)
    if p.offsets is not None:
        doc = torch.zeros(p.T, dtype=torch.long, device=device)
        for start in p.offsets[1:-1]:
            doc[start:] += 1
        mask &= doc[:, None] == doc[None, :]
    return mask


def _log_probs(q, k, scale, mask, dtype):
    """log softmax of the masked scores, [B, H, T, S]; GQA by repeating key heads."""
    H = q.shape[2]
    k = k.to(dtype).repeat_interleave(H // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.to(dtype), k) * scale
    return torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def naive_attention_kl(q_t, k_t, q_s, k_s, *, scale_t=None, scale_s=None, causal=True,
                       reduction="mean", cu_seqlens=None):
    """KL(P_teacher || P_student) per query row, from the full score matrices.

    Args:
        q_t: [B, T, H, D_t], k_t: [B, S, H_kv_t, D_t]: the teacher's queries and keys.
        q_s: [B, T, H, D_s], k_s: [B, S, H_kv_s, D_s]: the student's.
        scale_t, scale_s: softmax scales, default D_t ** -0.5 and D_s ** -0.5.
        causal: bottom-right aligned causal mask (see :mod:`hyla.ops.streamkl.checks`).
        reduction: "none" -> [B, H, T]; "sum"; "mean" over rows that see at least one key.
        cu_seqlens: optional int [N + 1] offsets of packed documents (B == 1, S == T).
    Returns:
        float32 (float64 for float64 inputs) KL; differentiable in all four inputs.

    Example:
        >>> q = torch.randn(1, 6, 2, 8); k = torch.randn(1, 6, 1, 8)
        >>> naive_attention_kl(q, k, q, k, reduction="none").abs().max().item()
        0.0
    """
    p = check_kl_inputs(q_t, k_t, q_s, k_s, scale_t, scale_s, causal, reduction, cu_seqlens)
    dtype = torch.promote_types(q_t.dtype, torch.float32)
    rows = valid_rows(p, q_t.device)
    # Fully masked rows would make log_softmax NaN (and NaN gradients leak through any
    # later where): let them see every key, then zero their KL.
    mask = key_mask(p, q_t.device) | ~rows[:, None]
    log_p = _log_probs(q_t, k_t, p.scale_t, mask, dtype)
    log_q = _log_probs(q_s, k_s, p.scale_s, mask, dtype)
    # P = 0 on masked keys, where log P - log Q = -inf - (-inf): fill before multiplying.
    diff = (log_p - log_q).masked_fill(~mask, 0.0)
    kl = (log_p.exp() * diff).sum(-1)
    kl = torch.where(rows, kl, torch.zeros((), dtype=dtype, device=kl.device))
    return reduce_kl(kl, p, reduction)
