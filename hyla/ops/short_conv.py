"""Short causal depthwise convolutions (a few taps a channel), over packed sequences and
continuing from each sequence's last inputs: the front of Gated DeltaNet's and Mamba-2's
projections, and LFM2's gated convolution layer.

A sequence's state is its last ``kernel - 1`` inputs (its "window"): prefill returns the
new window beside the output, decode shifts it by one token.
"""

from __future__ import annotations

import torch


def causal_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens=None, window=None,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of x [B, T, C] over each sequence (a batch row, or a
    document of ``cu_seqlens`` with B = 1), continuing after ``window`` [N, kernel - 1, C]
    (the sequences' previous inputs; None: zeros). ``weight`` [C, kernel] (tap ``kernel - 1``
    multiplies the current token, as ``nn.Conv1d(C, C, kernel, groups=C)``'s weight[:, 0]
    does). Returns (y [B, T, C], the new window: each sequence's last kernel - 1 inputs).

    Example:
        >>> x = torch.arange(6.0).view(1, 6, 1)
        >>> y, w = causal_conv(x, torch.tensor([[1.0, 1.0]]), torch.tensor([0, 2, 6]))
        >>> y[0, :, 0].tolist(), w[:, 0, 0].tolist()
        ([0.0, 1.0, 2.0, 5.0, 7.0, 9.0], [1.0, 5.0])
    """
    B, T, C = x.shape
    n = weight.shape[-1] - 1
    dev = x.device
    lengths = (torch.full((B,), T, device=dev) if cu_seqlens is None
               else cu_seqlens[1:] - cu_seqlens[:-1])
    N = lengths.numel()
    if window is None:
        window = x.new_zeros(N, n, C)
    # One table of rows: every sequence's window, then every token; each token reads rows
    # t, t-1, ..., t-n of its own sequence, falling into its window before its start.
    rows = torch.cat([window.to(x.dtype).reshape(N * n, C), x.reshape(B * T, C)])
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lengths)
    start = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(B * T, device=dev) - start[seq]                  # within sequence
    back = pos[:, None] - torch.arange(n + 1, device=dev)[None]         # [BT, kernel]
    idx = torch.where(back >= 0, N * n + start[seq][:, None] + back,
                      seq[:, None] * n + n + back)
    taps = weight.flip(-1).T.to(x.dtype)                                # [kernel, C]
    y = (rows[idx] * taps).sum(1).view(B, T, C)
    if bias is not None:
        y = y + bias.to(x.dtype)
    # The new window: positions len-n .. len-1 of each sequence (into the old window where
    # the sequence is shorter than n).
    last = lengths[:, None] - n + torch.arange(n, device=dev)[None]     # [N, n]
    widx = torch.where(last >= 0, N * n + start[:, None] + last,
                       torch.arange(N, device=dev)[:, None] * n + n + last)
    return y, rows[widx]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x [B, 1, C], window [B, kernel - 1, C] ->
    (y [B, 1, C], the window shifted by this token).

    Example:
        >>> y, w = causal_conv_step(torch.ones(1, 1, 1), torch.tensor([[2.0, 1.0]]),
        ...                         torch.full((1, 1, 1), 3.0))
        >>> y.item(), w.item()
        (7.0, 1.0)
    """
    ext = torch.cat([window.to(x.dtype), x], dim=1)                      # [B, kernel, C]
    y = (ext * weight.T.to(ext.dtype)).sum(1, keepdim=True)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y, ext[:, 1:]
