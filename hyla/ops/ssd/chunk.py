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
    # the differences in float64 (exact where a chunk's decay is large), exp in f: rounding
    # the difference costs a relative 6e-8 of it in the exponent, which float32 has anyway
    diff = (acs[..., :, None] - acs[..., None, :]).to(f).masked_fill(~causal, float("-inf"))
    L = diff.exp() * dtc[..., None, :]                            # [M, H, C, C], w_j folded in
    scores = Cc @ Bc.transpose(-1, -2)                            # [M, G, C, C], once a group
    W = (scores[:, :, None] * L.view(M, G, R, Cn, Cn)).view(M, H, Cn, Cn)
    y = W @ xc                                                    # within the chunk
    # Between chunks the state is kept as [G, N, R * P]: a group's heads side by side, so
    # B and C multiply all of them in one product instead of being copied for each head.
    to_end = torch.exp(acs[..., -1:] - acs).to(f) * dtc            # [M, H, C]
    xw = (xc * to_end[..., None]).view(M, G, R, Cn, P).transpose(2, 3).reshape(
        M, G, Cn, R * P)
    update = Bc.transpose(-1, -2) @ xw                            # [M, G, N, R P]
    decay = torch.exp(acs[..., -1]).to(f).view(M, G, 1, R, 1)      # a whole chunk, a head
    decay_grid, update_grid = lay.to_grid(decay, update.view(M, G, N, R, P))
    state = (initial_state.to(f).view(N_seq, G, R, P, N).permute(0, 1, 4, 2, 3)
             if initial_state is not None else x.new_zeros(N_seq, G, N, R, P, dtype=f))
    entering = torch.empty_like(update_grid)
    for p in range(update_grid.shape[1]):
        entering[:, p] = state
        state = decay_grid[:, p] * state + update_grid[:, p]
    s_in = lay.from_grid(entering).reshape(M, G, N, R * P)
    read = (Cc @ s_in).view(M, G, Cn, R, P).transpose(2, 3)       # C_i S_in, [M, G, R, C, P]
    y = y + read.reshape(M, H, Cn, P) * torch.exp(acs).to(f)[..., None]
    out = lay.from_chunks(y)
    if D is not None:
        out = out + D.to(f)[:, None] * x.to(f)
    final = (state.permute(0, 1, 3, 4, 2).reshape(N_seq, H, P, N) if output_final_state
             else None)
    return out.to(x.dtype), final
