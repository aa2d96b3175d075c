"""Mamba-2's SSD one token at a time (decode): the state updated in place."""

from __future__ import annotations

import torch


def ssd_decode_step(x, dt, A, B, C, D, state):
    """One token for each of the sequences of ``state``, which is updated in place.

    x: [S, H, P]; dt: [S, H] >= 0; A: [H]; B, C: [S, G, N]; D: [H] or None;
    state: [S, H, P, N] float32 (each sequence's; a view into the caller's slots is fine).
    Returns y [S, H, P] in x's dtype.

    Example:
        >>> state = torch.zeros(2, 4, 3, 5)
        >>> y = ssd_decode_step(torch.randn(2, 4, 3), torch.rand(2, 4), -torch.rand(4),
        ...                     torch.randn(2, 1, 5), torch.randn(2, 1, 5), None, state)
        >>> y.shape, bool(state.abs().sum() > 0)
        (torch.Size([2, 4, 3]), True)
    """
    S, H, P = x.shape
    G = B.shape[1]
    f = state.dtype
    dtf = dt.to(f)
    Bh = B.to(f).repeat_interleave(H // G, dim=1)                  # [S, H, N]
    Ch = C.to(f).repeat_interleave(H // G, dim=1)
    xf = x.to(f)
    state.mul_(torch.exp(dtf * A.to(f))[..., None, None])
    state.add_((dtf[..., None] * xf)[..., None] * Bh[:, :, None, :])
    y = (state @ Ch[..., None])[..., 0]                            # [S, H, P]
    if D is not None:
        y = y + D.to(f)[:, None] * xf
    return y.to(x.dtype)
