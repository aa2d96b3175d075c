"""StreamKL as fused Triton kernels: the tile algorithm of :mod:`hyla.ops.streamkl.chunk`.

Same notation as chunk.py: ``z`` are the teacher's scores of a query row, ``y`` the
student's, ``P``/``Q`` their softmaxes. The forward kernel keeps, per query row and in
registers, the online-softmax statistics ``(m_t, l_t)``, ``(m_s, l_s)`` and the accumulator
``A = sum_j exp(z_j - m_t) (z_j - y_j)``; ``KL = A / l_t - lse_t + lse_s``. It writes the KL and
five statistics per row (``m_t, log l_t, m_s, log l_s, D = A / l_t``). The backward recomputes
every tile FlashAttention-2 style, with

    dKL/dy_j = Q_j - P_j,        dKL/dz_j = P_j ((z_j - y_j) - D),

in two kernels: one per query tile (dq of both sides, loop over keys), one per key tile and
query head (dk of both sides, loop over queries). GQA maps query head ``h`` to key head
``h // (H // H_kv)`` independently per side; dk is produced per *query* head in float32 and
summed over each group afterwards, which keeps the backward free of atomics (deterministic).

Supported by the kernels (anything else falls back to :func:`chunk_attention_kl`, same
results up to rounding): no ``cu_seqlens``; fp32, bf16 or fp16 inputs (fp64 falls back);
``T >= 1`` and ``S >= 1`` (any ``S``, causal bottom-right aligned as in chunk.py); any head
dims per side (padded to a power of two inside the kernel); CUDA tensors, or CPU tensors
when ``TRITON_INTERPRET=1`` was set before triton was imported (how the tests run).

Numerics: tiles are loaded, upcast to float32 and multiplied with ``input_precision="ieee"``
(no TF32), so fp32 inputs meet the 1e-5 contract; this favours accuracy over tensor-core
throughput for 16-bit inputs. Extra memory: O(B H T) statistics plus a float32 dk per query
head ([B, S, H, D], the size of q), no ``T x S`` tensor.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hyla.ops.streamkl.checks import KLProblem, check_kl_inputs, reduce_kl
from hyla.ops.streamkl.chunk import chunk_attention_kl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _scores(q, k_ptr, offs_n, stride_kn, offs_d, D, S, scale):
    """[BM, BN] fp32 scores of a loaded query tile q [BM, BD] against keys offs_n."""
    k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=(offs_n[:, None] < S) & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision="ieee") * scale, k


@triton.jit
def _visible(offs_m, offs_n, T, S, CAUSAL: tl.constexpr):
    """[BM, BN] mask: key in range and, when causal, at most the row's bottom-right position."""
    mask = (offs_n[None, :] < S) & (offs_m[:, None] < T)
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + (S - T))
    return mask


@triton.jit
def _key_end(i0, T, S, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the keys the last row of a query tile sees: causal tiles skip the rest."""
    if CAUSAL:
        return tl.maximum(tl.minimum(S, i0 + BLOCK_M + (S - T)), 0)
    return S


@triton.jit
def _fwd_kernel(
    QT, KT, QS, KS, KL, STATS,
    sqt_b, sqt_t, sqt_h, skt_b, skt_s, skt_h,
    sqs_b, sqs_t, sqs_h, sks_b, sks_s, sks_h,
    T, S, H, D_T, D_S, G_T, G_S, scale_t, scale_s,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BD_T: tl.constexpr, BD_S: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch index: b * stride_b overflows int32 beyond 2**31 elements
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    i0 = pid_m * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    dt, ds = tl.arange(0, BD_T), tl.arange(0, BD_S)
    qt = tl.load(QT + b * sqt_b + h * sqt_h + offs_m[:, None] * sqt_t + dt[None, :],
                 mask=(offs_m[:, None] < T) & (dt[None, :] < D_T), other=0.0).to(tl.float32)
    qs = tl.load(QS + b * sqs_b + h * sqs_h + offs_m[:, None] * sqs_t + ds[None, :],
                 mask=(offs_m[:, None] < T) & (ds[None, :] < D_S), other=0.0).to(tl.float32)
    kt_ptr = KT + b * skt_b + (h // G_T) * skt_h
    ks_ptr = KS + b * sks_b + (h // G_S) * sks_h
    m_t = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_M], tl.float32)
    l_s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, _key_end(i0, T, S, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = j0 + offs_n0
        z, _ = _scores(qt, kt_ptr, offs_n, skt_s, dt, D_T, S, scale_t)
        y, _ = _scores(qs, ks_ptr, offs_n, sks_s, ds, D_S, S, scale_s)
        diff = z - y   # taken before masking, so masked entries stay finite
        mask = _visible(offs_m, offs_n, T, S, CAUSAL)
        z = tl.where(mask, z, float("-inf"))
        y = tl.where(mask, y, float("-inf"))
        # Rows with no visible key yet keep m = -inf; shift them by 0 to avoid inf - inf.
        mt_new = tl.maximum(m_t, tl.max(z, 1))
        mt_safe = tl.where(mt_new == float("-inf"), 0.0, mt_new)
        alpha = tl.exp(m_t - mt_safe)
        e = tl.exp(z - mt_safe[:, None])
        l_t = l_t * alpha + tl.sum(e, 1)
        acc = acc * alpha + tl.sum(e * diff, 1)
        m_t = mt_new
        ms_new = tl.maximum(m_s, tl.max(y, 1))
        ms_safe = tl.where(ms_new == float("-inf"), 0.0, ms_new)
        l_s = l_s * tl.exp(m_s - ms_safe) + tl.sum(tl.exp(y - ms_safe[:, None]), 1)
        m_s = ms_new
    valid = l_t > 0   # a visible key contributes exp(0) = 1 at the row max
    ll_t = tl.log(tl.where(valid, l_t, 1.0))
    ll_s = tl.log(tl.where(valid, l_s, 1.0))
    m_t = tl.where(valid, m_t, 0.0)
    m_s = tl.where(valid, m_s, 0.0)
    d = acc / tl.where(valid, l_t, 1.0)
    # lse_s - lse_t grouped so that one key gives (z - y) + (y - z) = 0 exactly.
    kl = d + (m_s - m_t) + (ll_s - ll_t)
    row = pid_bh * T + offs_m
    rmask = offs_m < T
    n = tl.num_programs(1) * T   # B * H * T: stride between the five statistics
    tl.store(KL + row, kl, mask=rmask)
    tl.store(STATS + row, m_t, mask=rmask)
    tl.store(STATS + n + row, ll_t, mask=rmask)
    tl.store(STATS + 2 * n + row, m_s, mask=rmask)
    tl.store(STATS + 3 * n + row, ll_s, mask=rmask)
    tl.store(STATS + 4 * n + row, d, mask=rmask)


@triton.jit
def _grad_tiles(z, y, mask, m_t, ll_t, m_s, ll_s, d, g, TEACHER: tl.constexpr):
    """g (Q - P) and, for the teacher, g P ((z - y) - D) of one [BM, BN] tile."""
    diff = z - y
    pt = tl.where(mask, tl.exp(z - m_t[:, None] - ll_t[:, None]), 0.0)
    qs = tl.where(mask, tl.exp(y - m_s[:, None] - ll_s[:, None]), 0.0)
    dy = (qs - pt) * g[:, None]
    dz = dy   # placeholder when the teacher needs no gradient
    if TEACHER:
        dz = pt * (diff - d[:, None]) * g[:, None]
    return dy, dz


@triton.jit
def _load_row_stats(STATS, GRAD, row, rmask, n):
    m_t = tl.load(STATS + row, mask=rmask, other=0.0)
    ll_t = tl.load(STATS + n + row, mask=rmask, other=0.0)
    m_s = tl.load(STATS + 2 * n + row, mask=rmask, other=0.0)
    ll_s = tl.load(STATS + 3 * n + row, mask=rmask, other=0.0)
    d = tl.load(STATS + 4 * n + row, mask=rmask, other=0.0)
    g = tl.load(GRAD + row, mask=rmask, other=0.0)
    return m_t, ll_t, m_s, ll_s, d, g


@triton.jit
def _bwd_dq_kernel(
    QT, KT, QS, KS, STATS, GRAD, DQT, DQS,
    sqt_b, sqt_t, sqt_h, skt_b, skt_s, skt_h,
    sqs_b, sqs_t, sqs_h, sks_b, sks_s, sks_h,
    T, S, H, D_T, D_S, G_T, G_S, scale_t, scale_s,
    CAUSAL: tl.constexpr, TEACHER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BD_T: tl.constexpr, BD_S: tl.constexpr,
):
    """dq of both sides for one query tile; DQT/DQS are contiguous [B, T, H, D] fp32."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch index: b * stride_b overflows int32 beyond 2**31 elements
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    i0 = pid_m * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    dt, ds = tl.arange(0, BD_T), tl.arange(0, BD_S)
    qmask_t = (offs_m[:, None] < T) & (dt[None, :] < D_T)
    qmask_s = (offs_m[:, None] < T) & (ds[None, :] < D_S)
    qt = tl.load(QT + b * sqt_b + h * sqt_h + offs_m[:, None] * sqt_t + dt[None, :],
                 mask=qmask_t, other=0.0).to(tl.float32)
    qs = tl.load(QS + b * sqs_b + h * sqs_h + offs_m[:, None] * sqs_t + ds[None, :],
                 mask=qmask_s, other=0.0).to(tl.float32)
    kt_ptr = KT + b * skt_b + (h // G_T) * skt_h
    ks_ptr = KS + b * sks_b + (h // G_S) * sks_h
    rmask = offs_m < T
    m_t, ll_t, m_s, ll_s, d, g = _load_row_stats(STATS, GRAD, pid_bh * T + offs_m, rmask,
                                                  tl.num_programs(1) * T)
    dqt = tl.zeros([BLOCK_M, BD_T], tl.float32)
    dqs = tl.zeros([BLOCK_M, BD_S], tl.float32)
    for j0 in range(0, _key_end(i0, T, S, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = j0 + offs_n0
        z, kt = _scores(qt, kt_ptr, offs_n, skt_s, dt, D_T, S, scale_t)
        y, ks = _scores(qs, ks_ptr, offs_n, sks_s, ds, D_S, S, scale_s)
        mask = _visible(offs_m, offs_n, T, S, CAUSAL)
        dy, dz = _grad_tiles(z, y, mask, m_t, ll_t, m_s, ll_s, d, g, TEACHER)
        dqs += tl.dot(dy, ks, input_precision="ieee")
        if TEACHER:
            dqt += tl.dot(dz, kt, input_precision="ieee")
    # DQ* are [B, T, H, D] contiguous: row stride H * D.
    tl.store(DQS + ((b * T + offs_m[:, None]) * H + h) * D_S + ds[None, :], dqs * scale_s,
             mask=qmask_s)
    if TEACHER:
        tl.store(DQT + ((b * T + offs_m[:, None]) * H + h) * D_T + dt[None, :], dqt * scale_t,
                 mask=qmask_t)


@triton.jit
def _bwd_dk_kernel(
    QT, KT, QS, KS, STATS, GRAD, DKT, DKS,
    sqt_b, sqt_t, sqt_h, skt_b, skt_s, skt_h,
    sqs_b, sqs_t, sqs_h, sks_b, sks_s, sks_h,
    T, S, H, D_T, D_S, G_T, G_S, scale_t, scale_s,
    CAUSAL: tl.constexpr, TEACHER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BD_T: tl.constexpr, BD_S: tl.constexpr,
):
    """dk of both sides for one key tile and one *query* head; DKT/DKS are contiguous
    [B, S, H, D] fp32, summed over each GQA group by the caller."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    # int64 batch index: b * stride_b overflows int32 beyond 2**31 elements
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    j0 = pid_n * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    dt, ds = tl.arange(0, BD_T), tl.arange(0, BD_S)
    kt_ptr = KT + b * skt_b + (h // G_T) * skt_h
    ks_ptr = KS + b * sks_b + (h // G_S) * sks_h
    n = tl.num_programs(1) * T
    dkt = tl.zeros([BLOCK_N, BD_T], tl.float32)
    dks = tl.zeros([BLOCK_N, BD_S], tl.float32)
    # Causal: the first row that sees key j0 is j0 - (S - T); start at its tile.
    i_start = 0
    if CAUSAL:
        i_start = (tl.maximum(j0 - (S - T), 0) // BLOCK_M) * BLOCK_M
    for i0 in range(i_start, T, BLOCK_M):
        offs_m = i0 + offs_m0
        rmask = offs_m < T
        qt = tl.load(QT + b * sqt_b + h * sqt_h + offs_m[:, None] * sqt_t + dt[None, :],
                     mask=rmask[:, None] & (dt[None, :] < D_T), other=0.0).to(tl.float32)
        qs = tl.load(QS + b * sqs_b + h * sqs_h + offs_m[:, None] * sqs_t + ds[None, :],
                     mask=rmask[:, None] & (ds[None, :] < D_S), other=0.0).to(tl.float32)
        z, _ = _scores(qt, kt_ptr, offs_n, skt_s, dt, D_T, S, scale_t)
        y, _ = _scores(qs, ks_ptr, offs_n, sks_s, ds, D_S, S, scale_s)
        m_t, ll_t, m_s, ll_s, d, g = _load_row_stats(STATS, GRAD, pid_bh * T + offs_m, rmask, n)
        mask = _visible(offs_m, offs_n, T, S, CAUSAL)
        dy, dz = _grad_tiles(z, y, mask, m_t, ll_t, m_s, ll_s, d, g, TEACHER)
        dks += tl.dot(tl.trans(dy), qs, input_precision="ieee")
        if TEACHER:
            dkt += tl.dot(tl.trans(dz), qt, input_precision="ieee")
    kmask = offs_n[:, None] < S
    tl.store(DKS + ((b * S + offs_n[:, None]) * H + h) * D_S + ds[None, :], dks * scale_s,
             mask=kmask & (ds[None, :] < D_S))
    if TEACHER:
        tl.store(DKT + ((b * S + offs_n[:, None]) * H + h) * D_T + dt[None, :], dkt * scale_t,
                 mask=kmask & (dt[None, :] < D_T))


def _pad(d: int) -> int:
    # tl.arange needs a power of two; tl.dot on GPUs wants at least 16.
    return max(16, triton.next_power_of_2(d))


def _common_args(p: KLProblem, q_t, k_t, q_s, k_s):
    """Strides (innermost dims are made contiguous by the caller) and sizes for every kernel."""
    strides = []
    for x in (q_t, k_t, q_s, k_s):
        strides += [x.stride(0), x.stride(1), x.stride(2)]
    D_t, D_s = q_t.shape[3], q_s.shape[3]
    return (*strides, p.T, p.S, p.H, D_t, D_s, p.H // p.H_kv_t, p.H // p.H_kv_s,
            p.scale_t, p.scale_s)


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _TritonStreamKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_t, k_t, q_s, k_s, p: KLProblem, block_m: int, block_n: int):
        q_t, k_t, q_s, k_s = (_last_contig(x) for x in (q_t, k_t, q_s, k_s))
        kl = torch.empty(p.B, p.H, p.T, dtype=torch.float32, device=q_t.device)
        stats = torch.empty(5, p.B, p.H, p.T, dtype=torch.float32, device=q_t.device)
        bd = (_pad(q_t.shape[3]), _pad(q_s.shape[3]))
        grid = (triton.cdiv(p.T, block_m), p.B * p.H)
        _fwd_kernel[grid](q_t, k_t, q_s, k_s, kl, stats, *_common_args(p, q_t, k_t, q_s, k_s),
                          CAUSAL=p.causal, BLOCK_M=block_m, BLOCK_N=block_n,
                          BD_T=bd[0], BD_S=bd[1])
        ctx.save_for_backward(q_t, k_t, q_s, k_s, stats)
        ctx.problem, ctx.blocks = p, (block_m, block_n)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q_t, k_t, q_s, k_s, stats = ctx.saved_tensors
        p, (block_m, block_n) = ctx.problem, ctx.blocks
        teacher = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad = grad.to(torch.float32).contiguous()
        dev, f32 = q_t.device, torch.float32
        D_t, D_s = q_t.shape[3], q_s.shape[3]
        dq_s = torch.empty(p.B, p.T, p.H, D_s, dtype=f32, device=dev)
        dk_s = torch.empty(p.B, p.S, p.H, D_s, dtype=f32, device=dev)   # per query head
        # Without teacher grads the kernels never touch these: any fp32 pointer will do.
        dq_t = torch.empty(p.B, p.T, p.H, D_t, dtype=f32, device=dev) if teacher else dq_s
        dk_t = torch.empty(p.B, p.S, p.H, D_t, dtype=f32, device=dev) if teacher else dk_s
        args = _common_args(p, q_t, k_t, q_s, k_s)
        meta = {"CAUSAL": p.causal, "TEACHER": teacher, "BLOCK_M": block_m,
                "BLOCK_N": block_n, "BD_T": _pad(D_t), "BD_S": _pad(D_s)}
        _bwd_dq_kernel[(triton.cdiv(p.T, block_m), p.B * p.H)](
            q_t, k_t, q_s, k_s, stats, grad, dq_t, dq_s, *args, **meta)
        _bwd_dk_kernel[(triton.cdiv(p.S, block_n), p.B * p.H)](
            q_t, k_t, q_s, k_s, stats, grad, dk_t, dk_s, *args, **meta)

        def group(dk, h_kv, like):   # [B, S, H, D] per query head -> [B, S, H_kv, D]
            return dk.view(p.B, p.S, h_kv, p.H // h_kv, -1).sum(3).to(like.dtype)

        grads_s = (dq_s.to(q_s.dtype), group(dk_s, p.H_kv_s, k_s))
        if not teacher:
            return None, None, *grads_s, None, None, None
        return dq_t.to(q_t.dtype), group(dk_t, p.H_kv_t, k_t), *grads_s, None, None, None


def kernel_supports(p: KLProblem, x: torch.Tensor) -> bool:
    """Whether the fused kernels handle this problem (else :func:`triton_attention_kl` falls
    back to the chunk backend): no cu_seqlens, T, S >= 1, fp32/bf16/fp16, on CUDA (or on the
    CPU under ``TRITON_INTERPRET=1``)."""
    on_device = x.is_cuda or (INTERPRET and x.device.type == "cpu")
    return (on_device and p.offsets is None and p.T > 0 and p.S > 0
            and x.dtype in KERNEL_DTYPES)


def triton_attention_kl(q_t, k_t, q_s, k_s, *, scale_t=None, scale_s=None, causal=True,
                        reduction="mean", cu_seqlens=None, block_m=64, block_n=64,
                        block_q=256, block_k=512):
    """KL(P_teacher || P_student) per query row with fused Triton kernels.

    Same contract as :func:`hyla.ops.streamkl.chunk_attention_kl`; problems the kernels do
    not handle (see :func:`kernel_supports`: packed ``cu_seqlens``, fp64, empty T or S,
    non-CUDA tensors) are computed by the chunk backend instead.

    Args:
        q_t: [B, T, H, D_t], k_t: [B, S, H_kv_t, D_t]: the teacher's queries and keys.
        q_s: [B, T, H, D_s], k_s: [B, S, H_kv_s, D_s]: the student's.
        scale_t, scale_s: softmax scales, default D_t ** -0.5 and D_s ** -0.5.
        causal: bottom-right aligned causal mask (see :mod:`hyla.ops.streamkl.checks`).
        reduction: "none" -> [B, H, T]; "sum"; "mean" over rows that see at least one key.
        cu_seqlens: optional int [N + 1] offsets of packed documents: falls back to chunk.
        block_m, block_n: query rows and keys per kernel tile (powers of two, >= 16).
        block_q, block_k: tile sizes of the chunk fallback.
    Returns:
        KL in float32 (float64 only through the fallback); gradients flow to q_s, k_s and,
        when they require grad, q_t and k_t.

    Example (on a CPU the chunk backend answers):
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
        >>> q = torch.randn(1, 100, 4, 16, device=dev); k = torch.randn(1, 100, 2, 16, device=dev)
        >>> kl = triton_attention_kl(q, k, q + 0.1 * torch.randn_like(q), k)
        >>> kl.shape, bool(kl > 0)
        (torch.Size([]), True)
    """
    p = check_kl_inputs(q_t, k_t, q_s, k_s, scale_t, scale_s, causal, reduction, cu_seqlens)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    if not kernel_supports(p, q_t):
        return chunk_attention_kl(q_t, k_t, q_s, k_s, scale_t=scale_t, scale_s=scale_s,
                                  causal=causal, reduction=reduction, cu_seqlens=cu_seqlens,
                                  block_q=block_q, block_k=block_k)
    kl = _TritonStreamKL.apply(q_t, k_t, q_s, k_s, p, block_m, block_n)
    return reduce_kl(kl, p, reduction)
