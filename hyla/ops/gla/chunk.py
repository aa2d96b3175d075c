"""Chunked parallel GLA (training and prefill) in plain PyTorch.

The sequence is cut into chunks of C tokens. Inside a chunk, with G the cumulative log gate
(relative to the chunk start, float32),

    o_i = (q_i * exp(G_i)) S_0  +  sum_{j <= i} <q_i * exp(G_i - G_j), k_j> v_j
    S_C = diag(exp(G_C)) S_0    +  sum_j (k_j * exp(G_C - G_j))^T v_j

Factoring exp(G_i - G_j) as exp(G_i) * exp(-G_j) over a whole chunk overflows as soon as the
gates are harsh (G reaches -1280 over 64 tokens at -20 a step). Instead the chunk is split
into sub-blocks of ``SUB`` rows (secondary chunking): a query sub-block a and every earlier key
row j meet through a reference row r (the row just before block a), exp(G_i - G_r) *
exp(G_r - G_j), both factors <= 1, one matmul; the diagonal sub-blocks are computed
elementwise, exp(G_i - G_j) with j <= i, also <= 1. Nothing ever exceeds 1, so any gate is safe.

The elementwise diagonal dominates eager time (an [S, S, K] tensor per sub-block); the pure
per-chunk pieces can be compiled with ``torch.compile`` (see :func:`set_compile`), the
sequential scan over chunks stays a short Python loop.
"""

from __future__ import annotations

import os

import torch

from hyla.ops.gla.checks import check_gla_inputs
from hyla.ops.gla.layout import ChunkLayout
from hyla.ops.gla.scores import intra_scores

CHUNK_SIZES = (16, 32, 64, 128)

_compile = {"enabled": os.environ.get("HYLA_COMPILE", "0") == "1", "fn": None}


def set_compile(enabled: bool) -> None:
    """Use ``torch.compile`` for the per-chunk pieces (default off; env ``HYLA_COMPILE=1``)."""
    _compile["enabled"] = bool(enabled)


def _intra_fn():
    if not _compile["enabled"]:
        return intra_chunk
    if _compile["fn"] is None:
        _compile["fn"] = torch.compile(intra_chunk, dynamic=True)
    return _compile["fn"]


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64):
    """Chunked GLA: the same result as :func:`naive_recurrent_gla`, in parallel over chunks.

    Args:
        q, k, g: [B, T, H, K]; g the log forget gate (<= 0) per key channel, any magnitude.
        v: [B, T, H, V].
        scale: query scale, default K ** -0.5.
        initial_state: optional [N, H, K, V] (N = B, or the number of sequences).
        output_final_state: also return the [N, H, K, V] float32 state after the last token.
        cu_seqlens: optional int [N + 1] offsets of packed sequences (B must be 1); the state
            resets at every boundary.
        chunk_size: 16, 32, 64 or 128.
    Returns:
        (o [B, T, H, V] in q's dtype, final_state or None).

    Example:
        >>> B, T, H, K, V = 2, 100, 4, 32, 32
        >>> q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v = torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
        >>> o, s = chunk_gla(q, k, v, g, output_final_state=True)
        >>> o.shape, s.shape
        (torch.Size([2, 100, 4, 32]), torch.Size([2, 4, 32, 32]))
    """
    N, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = ChunkLayout(B, T, cu_seqlens, chunk_size, q.device)
    qc, kc, vc, gc = (layout.to_chunks(x) for x in (q * scale, k, v, g))  # [M, H, C, D]
    if layout.num_chunks == 0:
        o = q.new_zeros(B, T, H, V)
        s0 = initial_state.float() if initial_state is not None else q.new_zeros(
            N, H, K, V, dtype=torch.float32)
        return o, (s0 if output_final_state else None)

    o_intra, G, decay, update = _intra_fn()(qc, kc, vc, gc.float())
    starts, final = _scan(layout, decay, update, initial_state, N, H, K, V)
    o_inter = torch.matmul(qc * G.exp().to(qc.dtype), starts.to(qc.dtype))
    o = layout.from_chunks((o_intra + o_inter.float()).to(q.dtype))
    return o, (final if output_final_state else None)


def intra_chunk(q, k, v, g):
    """Everything that is local to a chunk: one batched pass over all chunks.

    Args: q (pre-scaled), k: [M, H, C, K]; v: [M, H, C, V]; g float32 [M, H, C, K].
    Returns: o_intra [M, H, C, V] float32 (the within-chunk part of the output), G the
    cumulative gate [M, H, C, K], decay = exp(G_C) [M, H, K] and the chunk's state update
    sum_j (k_j exp(G_C - G_j))^T v_j [M, H, K, V], both float32.
    """
    dtype = q.dtype
    G = g.cumsum(2)
    A = intra_scores(q, k, G)  # [M, H, C, C]
    o_intra = torch.matmul(A.to(dtype), v).float()

    G_last = G[:, :, -1]
    k_dec = (k * (G_last.unsqueeze(-2) - G).exp()).to(dtype)
    update = torch.matmul(k_dec.transpose(-1, -2), v).float()
    return o_intra, G, G_last.exp(), update


def _scan(layout: ChunkLayout, decay, update, initial_state, N, H, K, V):
    """Carry the state across chunks: S <- diag(decay) S + update, per sequence.

    Returns the state at the start of every chunk [M, H, K, V] and the final states [N, ...].
    """
    decay_grid, update_grid = layout.to_grid(decay, update)  # [N, P, H, K], [N, P, H, K, V]
    if initial_state is not None:
        s = initial_state.float()
    else:
        s = decay.new_zeros(N, H, K, V)
    starts = []
    for p in range(decay_grid.shape[1]):
        starts.append(s)
        s = s * decay_grid[:, p].unsqueeze(-1) + update_grid[:, p]
    return layout.from_grid(torch.stack(starts, dim=1)), s
