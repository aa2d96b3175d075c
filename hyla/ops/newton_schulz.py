"""Newton-Schulz orthogonalisation: the matrix function at the heart of Muon.

A pure tensor function (no optimizer state), so it lives with the other ops; the optimizers
in :mod:`hyla.train.optim.muon` and :mod:`hyla.train.optim.dist_muon` call it.
"""

from __future__ import annotations

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon
NS_EPS = 1e-7


def newton_schulz(g: Tensor, steps: int = 5, *, dtype: torch.dtype = torch.bfloat16,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> Tensor:
    """Approximately orthogonalise ``g`` ([A, B] or a batch [N, A, B]); returns ``dtype``.

    Runs the quintic iteration ``X <- a X + (b S + c S^2) X`` with ``S = X X^T`` on the wide
    orientation (rows <= columns), so the Gram matrix is the small one. The op order copies
    ``torch.optim.Muon`` so a 2-D call is bit-identical to it; a 3-D call batches equal-shape
    matrices in one ``baddbmm`` each (what the distributed owner does).

    Example:
        >>> o = newton_schulz(torch.randn(64, 32), dtype=torch.float32)
        >>> s = torch.linalg.svdvals(o)
        >>> bool(s.min() > 0.5 and s.max() < 1.5)
        True
    """
    if g.ndim not in (2, 3):
        raise ValueError(f"g must be a matrix [A, B] or a batch [N, A, B], got shape "
                         f"{tuple(g.shape)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        # Frobenius norm >= spectral norm: afterwards every singular value is <= 1.
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x
