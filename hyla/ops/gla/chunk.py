"""Chunked parallel GLA (training and prefill) in plain PyTorch.

The sequence is cut into chunks of C tokens. Inside a chunk, with G the cumulative log gate
(relative to the chunk start, float32),

    o_i = (q_i * exp(G_i)) S_0  +  sum_{j <= i} <q_i * exp(G_i - G_j), k_j> v_j
    S_C = diag(exp(G_C)) S_0    +  sum_j (k_j * exp(G_C - G_j))^T v_j

Factoring exp(G_i - G_j) as exp(G_i) * exp(-G_j) over a whole chunk overflows as soon as the
gates are harsh (G reaches -1280 over 64 tokens at -20 a step). The within-chunk scores are
computed by :func:`hyla.ops.gla.scores.intra_scores` instead: hierarchical secondary chunking
with reference rows, where no factor exceeds 1, so any gate is safe. The inter-chunk terms
only ever use exp(G_i) and exp(G_C - G_j), both <= 1.

Everything local to a chunk is one batched pass over all chunks; only the scan that carries
the state from chunk to chunk is a (short, T / C steps) Python loop. ``torch.compile`` of the
per-chunk pass was measured and gave nothing (140 vs 135 ms at T = 4096 on CPU), because the
hierarchical scores leave no large elementwise tensor to fuse, so there is no compiled path.
"""

from __future__ import annotations

import torch

from hyla.ops.checks.gla import check_gla_inputs, check_inplace, resolve_gate, write_back
from hyla.ops.gla.layout import ChunkLayout
from hyla.ops.gla.scores import intra_scores
from hyla.ops.hardware import fast_low_precision_matmul

CHUNK_SIZES = (16, 32, 64, 128)


def chunk_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64, *, gk=None, inplace=False):
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
        gk: flash-linear-attention's name for ``g`` (pass one of them).
        inplace: write the final state into ``initial_state`` (inference only) and return
            it as the final state; otherwise ``initial_state`` is never modified.
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
    g = resolve_gate(g, gk)
    N, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
    check_inplace(inplace, initial_state, q, k, v, g)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = ChunkLayout(B, T, cu_seqlens, chunk_size, q.device)
    if layout.num_chunks == 0:
        o = q.new_zeros(B, T, H, V)
        s0 = initial_state.float() if initial_state is not None else q.new_zeros(
            N, H, K, V, dtype=torch.float32)
        s0 = write_back(initial_state, s0, inplace)
        return o, (s0 if output_final_state else None)
    o, final = _ChunkGLA.apply(q, k, v, g, initial_state, scale, layout)
    final = write_back(initial_state, final, inplace)
    return o, (final if output_final_state else None)


class _ChunkGLA(torch.autograd.Function):
    """Autograd through the chunk math for q, k, v and the initial state; the gate gradient
    in closed form.

    Every appearance of the cumulative gate G_t is exp(G_t) on q_t or exp(-G_t) on k_t (plus
    exp(G_T) on the final state), so dL/dG_t = q_t dq_t - k_t dk_t (+ the final state's term)
    and dg is its reverse cumulative sum. Differentiating through the exponentials instead
    subtracts two large, nearly equal terms per gate, which loses the gradient's last
    digits when the matmuls run in bf16 (measured: 6e-3 relative error against 5e-3 allowed).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, layout):
        o, final = _chunk_forward(q, k, v, g, initial_state, scale, layout)
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.scale, ctx.layout = scale, layout
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, h0 = ctx.saved_tensors
        layout = ctx.layout
        # Recompute in fp32: dq and dk feed a difference of near-equal terms below, so they
        # must carry fp32 precision (bf16-rounded ones gave 1e-2 relative error in dg).
        with torch.enable_grad():
            leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
            if h0 is not None:
                leaves.append(h0.detach().float().requires_grad_())
            o, final = _chunk_forward(*leaves[:3], g.detach(),
                                      leaves[3] if h0 is not None else None, ctx.scale, layout)
            grads = torch.autograd.grad([o, final], leaves, [do.float(), dht])
        dq, dk, dv = grads[:3]
        dG = leaves[0].detach() * dq - leaves[1].detach() * dk
        dG = layout.add_at_last_tokens(dG, (dht * final.detach()).sum(-1))
        dg = layout.reverse_cumsum(dG).to(g.dtype)
        dh0 = grads[3].to(h0.dtype) if h0 is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dh0, None, None


def _chunk_forward(q, k, v, g, initial_state, scale, layout):
    """o [B, T, H, V] and the final states [N, H, K, V] of every sequence in ``layout``."""
    N, H, K, V = layout.N, q.shape[2], q.shape[3], v.shape[3]
    dtype = matmul_dtype(q)
    qc, kc, vc = (layout.to_chunks(x).to(dtype) for x in (q, k, v))  # [M, H, C, D]
    qc = qc * scale
    gc = layout.to_chunks(g).float()

    o_intra, G, decay, update = intra_chunk(qc, kc, vc, gc)
    starts, final = _scan(layout, decay, update, initial_state, N, H, K, V)
    o_inter = torch.matmul(qc * G.exp().to(dtype), starts.to(dtype))
    o = layout.from_chunks((o_intra.float() + o_inter.float()).to(q.dtype))
    return o, final


def intra_chunk(q, k, v, g):
    """Everything that is local to a chunk: one batched pass over all chunks.

    Args: q (pre-scaled), k: [M, H, C, K]; v: [M, H, C, V]; g float32 [M, H, C, K].
    Returns: o_intra [M, H, C, V] in q's dtype (the within-chunk part of the output), G the
    cumulative gate [M, H, C, K], decay = exp(G_C) [M, H, K] and the chunk's state update
    sum_j (k_j exp(G_C - G_j))^T v_j [M, H, K, V], both float32.
    """
    dtype = q.dtype
    G = g.cumsum(2)
    A = intra_scores(q, k, G)  # [M, H, C, C]
    o_intra = torch.matmul(A.to(dtype), v)
    G_last = G[:, :, -1]
    k_dec = (k * (G_last.unsqueeze(-2) - G).exp()).to(dtype)
    update = torch.matmul(k_dec.transpose(-1, -2), v).float()
    return o_intra, G, G_last.exp(), update


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the chunk matmuls run in: the input's where the hardware multiplies it fast,
    else fp32 (faster and more accurate there)."""
    return x.dtype if fast_low_precision_matmul(x.dtype, x.device) else torch.float32


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
    # unbind, not grid[:, p]: the backward of P selects would zero-fill P full-size grids.
    for decay_p, update_p in zip(decay_grid.unbind(1), update_grid.unbind(1), strict=True):
        starts.append(s)
        s = s * decay_p.unsqueeze(-1) + update_p
    return layout.from_grid(torch.stack(starts, dim=1)), s
