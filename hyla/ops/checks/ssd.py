"""Argument checks shared by every form of the Mamba-2 state-space dual (SSD) op."""

from __future__ import annotations

import torch

from hyla.ops.attention import check_cu_seqlens


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def check_ssd_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens) -> int:
    """Validate the SSD op contract; return the number of sequences N.

    x: [B, T, H, P]; dt: [B, T, H] >= 0 (the step, after its bias, softplus and limits);
    A: [H] <= 0; B, C: [B, T, G, N] with H a multiple of G (head h reads group
    h // (H / G)); D: [H] or None; initial_state: [N, H, P, N_state]; cu_seqlens: int
    [N + 1] offsets of packed sequences, only with B == 1.

    Example:
        >>> x = torch.zeros(1, 3, 4, 2)
        >>> check_ssd_inputs(x, torch.zeros(1, 3, 4), -torch.ones(4), torch.zeros(1, 3, 2, 5),
        ...                  torch.zeros(1, 3, 2, 5), None, None, None)
        1
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [B, T, H, P] tensor, got {_shape(x)}")
    Bsz, T, H, P = x.shape
    if not isinstance(dt, torch.Tensor) or tuple(dt.shape) != (Bsz, T, H):
        raise ValueError(f"dt must be [B, T, H] = {[Bsz, T, H]}, got {_shape(dt)}")
    if dt.numel() and bool((dt < 0).any()):
        raise ValueError(f"dt is a step size and must be >= 0, got min {dt.min().item():.4g}")
    if not isinstance(A, torch.Tensor) or tuple(A.shape) != (H,):
        raise ValueError(f"A must be [H] = [{H}] (one decay rate a head), got {_shape(A)}")
    if bool((A > 0).any()):
        raise ValueError(f"A must be <= 0 (the state decays), got max {A.max().item():.4g}")
    for name, t in (("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != (Bsz, T):
            raise ValueError(f"{name} must be [B, T, G, N] with B, T = {Bsz}, {T}, "
                             f"got {_shape(t)}")
    if B.shape != C.shape:
        raise ValueError(f"B and C must have one shape [B, T, G, N], got {tuple(B.shape)} and "
                         f"{tuple(C.shape)}")
    G, N_state = B.shape[2:]
    if G < 1 or H % G:
        raise ValueError(f"the heads H={H} must be a multiple of the groups G={G} of B and C")
    if D is not None and (not isinstance(D, torch.Tensor) or tuple(D.shape) != (H,)):
        raise ValueError(f"D must be [H] = [{H}] or None, got {_shape(D)}")
    N = len(check_cu_seqlens(cu_seqlens, Bsz, T)) - 1 if cu_seqlens is not None else Bsz
    if initial_state is not None:
        want = (N, H, P, N_state)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, H, P, N_state] = {list(want)}, "
                             f"got {_shape(initial_state)}")
    return N
