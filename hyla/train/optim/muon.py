"""Muon: momentum, then Newton-Schulz orthogonalisation, for the 2-D hidden weights.

The update of a matrix ``W [A, B]`` with gradient ``G`` is (``torch.optim.Muon`` conventions,
``adjust_lr_fn="match_rms_adamw"``)::

    M <- lerp(M, G, 1 - mu)                      # momentum buffer, EMA form
    U <- lerp(G, M, mu) if nesterov else M       # Nesterov look-ahead
    O <- NS_5(U)                                 # ~ U V^T of U's SVD, singular values ~[0.5, 1.5]
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

The 0.2 * sqrt(max(A, B)) factor gives O the RMS of a typical AdamW update (Moonshot's "Muon is
Scalable for LLM Training"), so Muon can reuse AdamW's learning rate and weight decay.
:mod:`hyla.train.optim.dist_muon` runs the same update with gradients sharded across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from hyla.ops.newton_schulz import NS_COEFFICIENTS, NS_EPS, newton_schulz

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "Muon", "newton_schulz", "ns_flops", "update_scale"]

def ns_flops(shape: tuple[int, int] | torch.Size, steps: int = 5) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on one ``[A, B]`` matrix (2 per multiply-add).

    With ``m = min(A, B)``, ``n = max(A, B)`` each step does ``X X^T`` (2 m^2 n), ``S S``
    (2 m^3) and ``(.) X`` (2 m^2 n).

    Example:
        >>> ns_flops((1024, 256), steps=1) == 4 * 256**2 * 1024 + 2 * 256**3
        True
    """
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * n + 2 * m**3)


def update_scale(shape: tuple[int, int] | torch.Size) -> float:
    """The factor 0.2 * sqrt(max(A, B)) that matches the RMS of an AdamW update.

    Example:
        >>> update_scale((3072, 8192)) == 0.2 * 8192 ** 0.5
        True
    """
    return 0.2 * math.sqrt(max(int(shape[0]), int(shape[1])))


def check_hyperparameters(lr: float, momentum: float, ns_steps: int,
                          weight_decay: float) -> None:
    """Raise ValueError naming the first bad argument (shared with the distributed Muon)."""
    if not 0 <= lr < float("inf"):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update ``buf`` in place and return the matrix to orthogonalise (elementwise: shardable)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


class Muon(torch.optim.Optimizer):
    """Muon for 2-D hidden weights on one device (see the module docstring for the update).

    ``ns_dtype`` is the Newton-Schulz precision: bf16 (the default, as ``torch.optim.Muon``)
    or float32 for exact comparisons. Route embeddings, the output head, norms and biases to
    AdamW, e.g. with :func:`hyla.train.optim.param_groups.build_optimizers`.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(32, 16))
        >>> opt = Muon([w], lr=0.02)
        >>> w.grad = torch.randn(32, 16)
        >>> before = w.detach().clone()
        >>> opt.step()
        >>> bool((w - before).abs().max() > 0)
        True
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 0.02,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.0, *, ns_dtype: torch.dtype = torch.bfloat16,
                 eps: float = NS_EPS):
        check_hyperparameters(lr, momentum, ns_steps, weight_decay)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay, ns_dtype=ns_dtype, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"params must all be 2-D matrices, got one of shape "
                                     f"{tuple(p.shape)}: route it to AdamW")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                u = momentum_update(p.grad, state["momentum_buffer"], group["momentum"],
                                    group["nesterov"])
                o = newton_schulz(u, group["ns_steps"], dtype=group["ns_dtype"],
                                  eps=group["eps"])
                # Decoupled decay uses the raw lr, as torch.optim.Muon and Moonlight do.
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-lr * update_scale(p.shape))
        return loss
