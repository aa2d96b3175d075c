"""StreamKL in plain PyTorch: KL(P_teacher || P_student) streamed over query and key tiles.

Notation: ``z`` are the teacher's scores of one query row, ``y`` the student's, ``P`` and
``Q`` their softmaxes (the issue calls them s, t, p, q). The forward keeps, per row, the
online-softmax statistics of both sides, ``(m_t, l_t)`` and ``(m_s, l_s)``, and one
accumulator

    A = sum_j exp(z_j - m_t) (z_j - y_j)      (rescaled by exp(m_old - m_new) when m_t grows)

so that, at the end, ``sum_j P_j (z_j - y_j) = A / l_t`` and

    KL = sum_j P_j (log P_j - log Q_j) = A / l_t - lse_t + lse_s.

The backward keeps per row only the two log-sum-exps (each as max and log-sum, see
:func:`_forward`) and ``D = A / l_t``, and recomputes every tile: with ``g`` the gradient of
the row's KL,

    dKL/dy_j = Q_j - P_j,        dKL/dz_j = P_j ((z_j - y_j) - D),

chained into dq and dk of each side as in FlashAttention's backward. No ``T x S`` tensor is
ever formed: extra memory is a few ``[B, H, block_q, block_k]`` tiles plus O(T) statistics.
"""

from __future__ import annotations

import torch

from hyla.ops.streamkl.checks import KLProblem, check_kl_inputs, reduce_kl

NEG_INF = float("-inf")


def _prep_q(q, h_kv, scale, dtype):
    """[B, T, H, D] -> scaled [B, H_kv, G, T, D] in ``dtype``, grouping query heads by key head."""
    B, T, H, D = q.shape
    return (q.to(dtype) * scale).view(B, T, h_kv, H // h_kv, D).permute(0, 2, 3, 1, 4) \
        .contiguous()


def _prep_k(k, dtype):
    return k.to(dtype).transpose(1, 2).contiguous()   # [B, H_kv, S, D]


def _q_tile(q5, i0, i1):
    """Rows i0:i1 of every query head as [B, H_kv, G * bq, D]: one GEMM per key head."""
    B, h_kv, G, _, D = q5.shape
    return q5[:, :, :, i0:i1].reshape(B, h_kv, G * (i1 - i0), D)


def _scores(q_tile, k, j0, j1, H, buf):
    """[B, H, bq, bk] scores of a query tile against keys j0:j1, written into ``buf``."""
    shape = (*q_tile.shape[:3], j1 - j0)
    z = torch.matmul(q_tile, k[:, :, j0:j1].transpose(-1, -2), out=_view(buf, shape))
    return z.view(z.shape[0], H, -1, j1 - j0)


def _buffers(n: int, q5, block_q: int, block_k: int):
    """Tile-sized scratch tensors, reused by every tile: with glibc's default allocator each
    fresh multi-MB temporary is an mmap whose page faults cost more than the arithmetic."""
    B, h_kv, G, T, _ = q5.shape
    size = B * h_kv * G * min(block_q, T) * block_k
    return [q5.new_empty(size) for _ in range(n)]


def _view(buf, shape):
    numel = 1
    for s in shape:
        numel *= s
    return buf[:numel].view(shape)


def _tile_mask(p: KLProblem, i0, i1, j0, j1, seg, device):
    """[bq, bk] causal mask of a tile, or None when every key of the tile is visible."""
    q0, _, k0, k1 = seg
    shift = (k1 - k0) - (seg[1] - q0)   # bottom-right alignment within the segment
    if not p.causal or (j1 - 1 - k0) <= (i0 - q0) + shift:
        return None
    rows = torch.arange(i0 - q0, i1 - q0, device=device)[:, None] + shift
    return torch.arange(j0 - k0, j1 - k0, device=device)[None, :] <= rows


def _key_range(p: KLProblem, i1, seg) -> int:
    """End of the keys that the last row of a query tile sees (causal tiles skip the rest)."""
    q0, q1, k0, k1 = seg
    if not p.causal:
        return k1
    return max(k0, min(k1, k0 + (i1 - q0) + (k1 - k0) - (q1 - q0)))


def _tiles(p: KLProblem, block_q: int):
    for seg in p.segments():
        for i0 in range(seg[0], seg[1], block_q):
            yield seg, i0, min(i0 + block_q, seg[1])


def _online(m, l, x):
    """Fold a tile of scores x [.., bk] into a row's (max, sum) and return them with
    exp(x - m_new) (computed in place in x) and the rescale factor of the old sum."""
    m_new = torch.maximum(m, x.amax(-1))
    # Rows with no visible key yet keep m = -inf; shift them by 0 to avoid inf - inf.
    m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
    alpha = torch.exp(m - m_safe)
    e = x.sub_(m_safe[..., None]).exp_()
    return m_new, l * alpha + e.sum(-1), e, alpha


def _forward(p: KLProblem, qt, kt, qs, ks, block_q, block_k):
    """Per-row KL [B, H, T] and the backward's statistics [5, B, H, T]: the row max and
    log-sum of each side (m_t, log l_t, m_s, log l_s) and D = A / l_t.

    Each log-sum-exp is kept as (max, log-sum) rather than one float: at logits of 1e4 an
    fp32 lse is off by up to 5e-4, and so would be every probability the backward recomputes.
    Teacher and student go through the same arithmetic, so identical inputs give KL 0 exactly.
    """
    B, H, T = p.B, p.H, p.T
    kl, stats = qt.new_zeros(B, H, T), qt.new_zeros(5, B, H, T)
    bufs = _buffers(3, qt, block_q, block_k)
    for seg, i0, i1 in _tiles(p, block_q):
        qa, qb = _q_tile(qt, i0, i1), _q_tile(qs, i0, i1)
        m_t, m_s = qt.new_full((2, B, H, i1 - i0), NEG_INF)
        l_t, l_s, acc = qt.new_zeros(3, B, H, i1 - i0)
        k_end = _key_range(p, i1, seg)
        for j0 in range(seg[2], k_end, block_k):
            j1 = min(j0 + block_k, k_end)
            z, y = _scores(qa, kt, j0, j1, H, bufs[0]), _scores(qb, ks, j0, j1, H, bufs[1])
            # taken before masking, so masked entries stay finite
            diff = torch.sub(z, y, out=_view(bufs[2], z.shape))
            mask = _tile_mask(p, i0, i1, j0, j1, seg, z.device)
            if mask is not None:
                z.masked_fill_(~mask, NEG_INF)
                y.masked_fill_(~mask, NEG_INF)
            m_t, l_t, e, alpha = _online(m_t, l_t, z)
            acc = acc * alpha + torch.linalg.vecdot(e, diff)
            m_s, l_s, _, _ = _online(m_s, l_s, y)
        valid = l_t > 0   # a visible key contributes exp(0) = 1 at the row max
        one = torch.ones((), dtype=kl.dtype, device=kl.device)
        ll_t = torch.log(torch.where(valid, l_t, one))
        ll_s = torch.log(torch.where(valid, l_s, one))
        m_t, m_s = torch.where(valid, m_t, 0.0), torch.where(valid, m_s, 0.0)
        d = acc / torch.where(valid, l_t, one)
        # lse_s - lse_t grouped so that one key gives (z - y) + (y - z) = 0 exactly.
        kl[..., i0:i1] = d + (m_s - m_t) + (ll_s - ll_t)
        stats[..., i0:i1] = torch.stack([m_t, ll_t, m_s, ll_s, d])
    return kl, stats


def _backward(p: KLProblem, qt, kt, qs, ks, stats, grad, teacher_grads, block_q, block_k):
    """Gradients of sum(grad * KL) w.r.t. the prepared (scaled) q and k of both sides."""
    H = p.H
    dqs, dks = torch.zeros_like(qs), torch.zeros_like(ks)
    dqt = torch.zeros_like(qt) if teacher_grads else None
    dkt = torch.zeros_like(kt) if teacher_grads else None
    bufs = _buffers(3, qt, block_q, block_k)
    for seg, i0, i1 in _tiles(p, block_q):
        qa, qb = _q_tile(qt, i0, i1), _q_tile(qs, i0, i1)
        B, bq = qa.shape[0], i1 - i0
        m_t, ll_t, m_s, ll_s, d = stats[..., i0:i1, None]
        g = grad[..., i0:i1, None]
        dqa, dqb = torch.zeros_like(qa) if teacher_grads else None, torch.zeros_like(qb)
        k_end = _key_range(p, i1, seg)
        for j0 in range(seg[2], k_end, block_k):
            j1 = min(j0 + block_k, k_end)
            z, y = _scores(qa, kt, j0, j1, H, bufs[0]), _scores(qb, ks, j0, j1, H, bufs[1])
            diff = torch.sub(z, y, out=_view(bufs[2], z.shape)) if teacher_grads else None
            mask = _tile_mask(p, i0, i1, j0, j1, seg, z.device)
            if mask is not None:
                z.masked_fill_(~mask, NEG_INF)
                y.masked_fill_(~mask, NEG_INF)
            pt = z.sub_(m_t).sub_(ll_t).exp_()                 # teacher probabilities P
            dy = y.sub_(m_s).sub_(ll_s).exp_().sub_(pt).mul_(g)   # g (Q - P)
            dy2 = dy.view(B, qb.shape[1], -1, j1 - j0)
            dqb += dy2 @ ks[:, :, j0:j1]
            dks[:, :, j0:j1] += dy2.transpose(-1, -2) @ qb
            if teacher_grads:
                dz = diff.sub_(d).mul_(pt).mul_(g)   # g P ((z - y) - D)
                dz2 = dz.view(B, qa.shape[1], -1, j1 - j0)
                dqa += dz2 @ kt[:, :, j0:j1]
                dkt[:, :, j0:j1] += dz2.transpose(-1, -2) @ qa
        dqs[:, :, :, i0:i1] = dqb.view(B, qb.shape[1], -1, bq, qb.shape[-1])
        if teacher_grads:
            dqt[:, :, :, i0:i1] = dqa.view(B, qa.shape[1], -1, bq, qa.shape[-1])
    return dqt, dkt, dqs, dks


def _unprep_q(dq5, scale, like):
    """Gradient w.r.t. the prepared q (scaled, [B, H_kv, G, T, D]) -> w.r.t. q [B, T, H, D]."""
    B, T, H, D = like.shape
    return (dq5 * scale).permute(0, 3, 1, 2, 4).reshape(B, T, H, D).to(like.dtype)


class _StreamKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_t, k_t, q_s, k_s, p: KLProblem, block_q: int, block_k: int):
        dtype = torch.promote_types(q_t.dtype, torch.float32)   # statistics: fp32 at least
        prepped = (_prep_q(q_t, p.H_kv_t, p.scale_t, dtype), _prep_k(k_t, dtype),
                   _prep_q(q_s, p.H_kv_s, p.scale_s, dtype), _prep_k(k_s, dtype))
        kl, stats = _forward(p, *prepped, block_q, block_k)
        ctx.save_for_backward(q_t, k_t, q_s, k_s, stats)
        ctx.problem, ctx.blocks = p, (block_q, block_k)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q_t, k_t, q_s, k_s, stats = ctx.saved_tensors
        p = ctx.problem
        dtype = stats.dtype
        teacher = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        prepped = (_prep_q(q_t, p.H_kv_t, p.scale_t, dtype), _prep_k(k_t, dtype),
                   _prep_q(q_s, p.H_kv_s, p.scale_s, dtype), _prep_k(k_s, dtype))
        dqt, dkt, dqs, dks = _backward(p, *prepped, stats, grad.to(dtype), teacher,
                                       *ctx.blocks)
        dq_s = _unprep_q(dqs, p.scale_s, q_s)
        dk_s = dks.transpose(1, 2).to(k_s.dtype)
        if not teacher:
            return None, None, dq_s, dk_s, None, None, None
        dq_t = _unprep_q(dqt, p.scale_t, q_t)
        dk_t = dkt.transpose(1, 2).to(k_t.dtype)
        return dq_t, dk_t, dq_s, dk_s, None, None, None


def chunk_attention_kl(q_t, k_t, q_s, k_s, *, scale_t=None, scale_s=None, causal=True,
                       reduction="mean", cu_seqlens=None, block_q=256, block_k=512):
    """KL(P_teacher || P_student) per query row, streamed tile by tile (any device).

    Args:
        q_t: [B, T, H, D_t], k_t: [B, S, H_kv_t, D_t]: the teacher's queries and keys.
        q_s: [B, T, H, D_s], k_s: [B, S, H_kv_s, D_s]: the student's.
        scale_t, scale_s: softmax scales, default D_t ** -0.5 and D_s ** -0.5.
        causal: bottom-right aligned causal mask (see :mod:`hyla.ops.streamkl.checks`).
        reduction: "none" -> [B, H, T]; "sum"; "mean" over rows that see at least one key.
        cu_seqlens: optional int [N + 1] offsets of packed documents (B == 1, S == T).
        block_q, block_k: query rows and keys per tile; a tile holds ``B * H * block_q *
            block_k`` scores, so large tiles keep matmuls dominant and Python overhead low.
    Returns:
        KL in float32 (float64 for float64 inputs); scores and statistics are computed in
        that dtype too, since the KL is a difference of scores that bf16 rounding would swamp.
        Gradients flow to q_s, k_s and, when they require grad, q_t and k_t.

    Example:
        >>> q = torch.randn(1, 100, 4, 16); k = torch.randn(1, 100, 2, 16)
        >>> kl = chunk_attention_kl(q, k, q + 0.1 * torch.randn_like(q), k, block_q=32)
        >>> kl.shape, bool(kl > 0)
        (torch.Size([]), True)
    """
    p = check_kl_inputs(q_t, k_t, q_s, k_s, scale_t, scale_s, causal, reduction, cu_seqlens)
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    kl = _StreamKL.apply(q_t, k_t, q_s, k_s, p, block_q, block_k)
    return reduce_kl(kl, p, reduction)
