"""The specification of Mamba-2's state-space dual (SSD): a token-by-token recurrence.

Per head h, with the state S of shape [P, N] and the head's group g = h // (H / G):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        (one scalar decay a head and token)
    y_t = S_t C_t + D x_t
"""

from __future__ import annotations

import torch

from hyla.ops.checks.deltanet import seq_offsets, state_dtype
from hyla.ops.checks.ssd import check_ssd_inputs


def naive_ssd(x, dt, A, B, C, D=None, initial_state=None, output_final_state=False,
              cu_seqlens=None):
    """Reference SSD, one token at a time in float32 (float64 for float64 inputs). Slow; the
    fast forms are checked against it.

    Args:
        x: [B, T, H, P]; dt: [B, T, H] >= 0; A: [H] <= 0; B, C: [B, T, G, N]; D: [H] or None.
        initial_state: optional [N, H, P, N_state] (N = B, or the sequences of cu_seqlens).
        cu_seqlens: optional int [N + 1] offsets of packed sequences (B must be 1).
    Returns:
        y [B, T, H, P] in x's dtype; final_state [N, H, P, N_state] float32, or None.

    Example:
        >>> x = torch.randn(1, 5, 4, 3)
        >>> y, s = naive_ssd(x, torch.rand(1, 5, 4), -torch.rand(4), torch.randn(1, 5, 2, 6),
        ...                  torch.randn(1, 5, 2, 6), output_final_state=True)
        >>> y.shape, s.shape
        (torch.Size([1, 5, 4, 3]), torch.Size([1, 4, 3, 6]))
    """
    check_ssd_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    f = state_dtype(x, dt, A, B, C, D, initial_state)
    xf, dtf, Af = x.to(f), dt.to(f), A.to(f)
    Bh = B.to(f).repeat_interleave(H // G, dim=2)           # [B, T, H, N]
    Ch = C.to(f).repeat_interleave(H // G, dim=2)
    y = xf.new_zeros(Bsz, T, H, P)
    finals = []
    for n, (b, start, end) in enumerate(seq_offsets(Bsz, T, cu_seqlens)):
        s = initial_state[n].to(f) if initial_state is not None else xf.new_zeros(H, P, N)
        for t in range(start, end):
            decay = torch.exp(dtf[b, t] * Af)                                   # [H]
            s = s * decay[:, None, None] + (dtf[b, t][:, None, None] * xf[b, t][:, :, None]
                                            * Bh[b, t][:, None, :])
            y[b, t] = torch.einsum("hpn,hn->hp", s, Ch[b, t])
        finals.append(s)
    if D is not None:
        y = y + D.to(f)[:, None] * xf
    final = torch.stack(finals) if output_final_state else None
    return y.to(x.dtype), final
