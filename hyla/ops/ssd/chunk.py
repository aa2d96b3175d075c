"""The chunked form of Mamba-2's SSD (prefill and training): matmuls inside chunks of C
tokens, a scan over chunks.

With one scalar decay a head, the decay between two tokens of a chunk is
exp(a_i - a_j) for the cumulative log decays a: a [C, C] matrix per head whose entries are
exponentials of differences (<= 0 below the diagonal, masked above), so no factor can
overflow whatever the step sizes, and no hierarchy is needed (GLA's per-channel decays need
one: :mod:`hyla.ops.gla.scores`). The cumulative sums are taken in float64, so their
differences keep float32's precision even where a chunk's decay reaches -1000. The
products C B^T are computed once per group of heads that shares B and C.

Per chunk (x: [C, P], B, C: [C, N] a head, w_j = dt_j):

    y      = (tril(C B^T) * exp(a_i - a_j) * w_j) x  +  exp(a_i) C S_in   (+ D x)
    S_out  = exp(a_C) S_in  +  sum_j exp(a_C - a_j) w_j x_j B_j^T

Sequences (batch rows or the documents of ``cu_seqlens``) are padded on their own to whole
chunks with zero tokens (dt = 0: they neither add to the state nor decay it).
"""

from __future__ import annotations

import torch

from hyla.ops.checks.deltanet import state_dtype
from hyla.ops.checks.ssd import check_ssd_inputs
from hyla.ops.gla.layout import ChunkLayout


def chunk_ssd(x, dt, A, B, C, D=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64):
    """SSD over whole sequences: the contract of :func:`~hyla.ops.ssd.naive.naive_ssd`, in
    chunks of ``chunk_size`` tokens. Differentiable (plain autograd).

    Example:
        >>> from hyla.ops.ssd.naive import naive_ssd
        >>> args = (torch.randn(1, 70, 4, 3), torch.rand(1, 70, 4), -torch.rand(4),
        ...         torch.randn(1, 70, 2, 6), torch.randn(1, 70, 2, 6), torch.randn(4))
        >>> torch.allclose(chunk_ssd(*args)[0], naive_ssd(*args)[0], atol=1e-4)
        True
    """
    N_seq = check_ssd_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G
    f = state_dtype(x, dt, A, B, C, D, initial_state)
    lay = ChunkLayout(Bsz, T, cu_seqlens, chunk_size, x.device)
    xc = lay.to_chunks(x.to(f))                                   # [M, H, C, P]
    dtc = lay.to_chunks(dt.to(f)[..., None])[..., 0]              # [M, H, C]
    Bc = lay.to_chunks(B.to(f))                                   # [M, G, C, N]
    Cc = lay.to_chunks(C.to(f))
    M, Cn = xc.shape[0], xc.shape[2]
    # cumulative log decays within each chunk, in float64 (their differences stay exact)
    acs = torch.cumsum((dtc * A.to(f)[None, :, None]).double(), dim=-1)        # [M, H, C]
    causal = torch.ones(Cn, Cn, dtype=torch.bool, device=x.device).tril()
    diff = (acs[..., :, None] - acs[..., None, :]).masked_fill(~causal, float("-inf"))
    L = torch.exp(diff).to(f) * dtc[..., None, :]                 # [M, H, C, C], w_j folded in
    scores = Cc @ Bc.transpose(-1, -2)                            # [M, G, C, C], once a group
    W = (scores[:, :, None] * L.view(M, G, R, Cn, Cn)).view(M, H, Cn, Cn)
    y = W @ xc                                                    # within the chunk
    # the state as [H, N, P] inside (every product below then reads contiguous rows)
    to_end = torch.exp(acs[..., -1:] - acs).to(f) * dtc            # [M, H, C]
    xw = (xc * to_end[..., None]).view(M, G, R, Cn, P)
    update = (Bc.transpose(-1, -2)[:, :, None] @ xw).view(M, H, N, P)   # sum_j w x_j B_j^T
    decay = torch.exp(acs[..., -1]).to(f)                         # [M, H]: a whole chunk
    decay_grid, update_grid = lay.to_grid(decay, update)           # [N_seq, P_chunks, ...]
    state = (initial_state.to(f).transpose(-1, -2) if initial_state is not None
             else x.new_zeros(N_seq, H, N, P, dtype=f))
    entering = torch.empty_like(update_grid)
    for p in range(update_grid.shape[1]):
        entering[:, p] = state
        state = decay_grid[:, p, :, None, None] * state + update_grid[:, p]
    s_in = lay.from_grid(entering).view(M, G, R, N, P)
    read = (Cc[:, :, None] @ s_in).view(M, H, Cn, P)               # C_i S_in
    y = y + read * torch.exp(acs).to(f)[..., None]
    out = lay.from_chunks(y)
    if D is not None:
        out = out + D.to(f)[:, None] * x.to(f)
    final = state.transpose(-1, -2).contiguous() if output_final_state else None
    return out.to(x.dtype), final
