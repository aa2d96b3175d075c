"""The ``fla`` backend: flash-linear-attention's Triton kernels behind hyla's op contracts.

What the adapter translates (hyla's contract on the left, fla 0.6's on the right):

- the gate: ``g``/``gk`` -> ``chunk_gla(g=)``, ``fused_recurrent_gla(gk=)``; a gated-delta
  decay a head -> ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule(g=)``, a
  decay a key channel -> ``chunk_kda`` / ``fused_recurrent_gated_delta_rule(gk=)``;
- ``cu_seqlens``: any int dtype -> int64, B must be 1 (checked first, with hyla's errors);
- ``initial_state``: any float dtype -> float32 (fla asserts it); never modified, as fla
  never modifies it; with ``inplace=True`` the final state is copied into it afterwards;
- ``use_qk_l2norm`` -> ``use_qk_l2norm_in_kernel``; ``scale`` resolved by hyla (K ** -0.5);
- outputs: ``o`` in q's dtype, the final state float32 (or None).

Every call is validated with hyla's own checks first, so bad input raises the same
``ValueError`` on every backend. ``chunk_size`` is hyla's tuning knob and is not passed: fla
picks its own. The kernels are imported on the first call that needs them (importing fla
imports Triton). :func:`make_fla_backend` takes another kernel loader: the tests run this
adapter on a CPU with fla's pure-PyTorch references (fla's Triton kernels do not run there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

from hyla.ops.backend_base import Backend
from hyla.ops.checks.deltanet import check_delta_inputs, pop_aliases, resolve_decay
from hyla.ops.checks.gla import check_gla_inputs, check_inplace, resolve_gate, write_back

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load_fla_kernels() -> SimpleNamespace:
    """fla's kernels (ImportError when flash-linear-attention is not installed)."""
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.kda import chunk_kda

    return SimpleNamespace(chunk_gla=chunk_gla, fused_recurrent_gla=fused_recurrent_gla,
                           chunk_gated_delta_rule=chunk_gated_delta_rule,
                           fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule,
                           chunk_kda=chunk_kda)


def make_fla_backend(load: Callable[[], SimpleNamespace] = load_fla_kernels, *,
                     name: str = "fla", require_cuda: bool = True, priority: int = 10
                     ) -> Backend:
    """A :class:`~hyla.ops.backends.Backend` running hyla's four linear-attention ops on the
    kernels ``load()`` returns (fla's own by default).

    Example (fla's kernels need CUDA, so on a CPU the backend declines):
        >>> b = make_fla_backend()
        >>> q = torch.zeros(1, 4, 2, 8)
        >>> print(b.supports("chunk_gla", (q, q, q, q), {}))
        the tensors are on cpu; fla's Triton kernels need CUDA
    """

    def kernels() -> SimpleNamespace:
        return load()

    def chunk_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, chunk_size=64, *, gk=None, inplace=False):
        g = resolve_gate(g, gk)
        _, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
        check_inplace(inplace, initial_state, q, k, v, g)
        o, ht = kernels().chunk_gla(q, k, v, g, scale=scale, initial_state=_h0(initial_state),
                                    output_final_state=output_final_state or inplace,
                                    cu_seqlens=_cu(cu_seqlens, q))
        return _finish(o, ht, q, initial_state, output_final_state, inplace)

    def recurrent_gla(q, k, v, g=None, scale=None, initial_state=None,
                      output_final_state=False, cu_seqlens=None, *, gk=None, inplace=False):
        g = resolve_gate(g, gk)
        _, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
        check_inplace(inplace, initial_state, q, k, v, g)
        o, ht = kernels().fused_recurrent_gla(
            q, k, v, gk=g, scale=scale, initial_state=_h0(initial_state),
            output_final_state=output_final_state or inplace, cu_seqlens=_cu(cu_seqlens, q))
        return _finish(o, ht, q, initial_state, output_final_state, inplace)

    def chunk_gated_delta(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, use_qk_l2norm=False,
                          chunk_size=64, *, gk=None, inplace=False, **kwargs):
        use_l2 = pop_aliases(kwargs, use_qk_l2norm)
        g = resolve_decay(g, gk)
        _, scale = check_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        check_inplace(inplace, initial_state, q, k, v, g, beta)
        fn = kernels().chunk_kda if g.dim() == 4 else kernels().chunk_gated_delta_rule
        o, ht = fn(q, k, v, g, beta, scale=scale, initial_state=_h0(initial_state),
                   output_final_state=output_final_state or inplace,
                   use_qk_l2norm_in_kernel=use_l2, cu_seqlens=_cu(cu_seqlens, q))
        return _finish(o, ht, q, initial_state, output_final_state, inplace)

    def recurrent_gated_delta(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, use_qk_l2norm=False,
                              *, gk=None, inplace=False, **kwargs):
        use_l2 = pop_aliases(kwargs, use_qk_l2norm)
        g = resolve_decay(g, gk)
        _, scale = check_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        check_inplace(inplace, initial_state, q, k, v, g, beta)
        gates = {"gk": g} if g.dim() == 4 else {"g": g}
        o, ht = kernels().fused_recurrent_gated_delta_rule(
            q, k, v, beta=beta, scale=scale, initial_state=_h0(initial_state),
            output_final_state=output_final_state or inplace, use_qk_l2norm_in_kernel=use_l2,
            cu_seqlens=_cu(cu_seqlens, q), **gates)
        return _finish(o, ht, q, initial_state, output_final_state, inplace)

    def supports(op: str, args: tuple, kwargs: dict) -> str | None:
        q = args[0] if args else kwargs.get("q")
        if not isinstance(q, torch.Tensor):
            return "q is not a tensor"
        if require_cuda and not q.is_cuda:
            return f"the tensors are on {q.device.type}; fla's Triton kernels need CUDA"
        if q.dtype not in DTYPES:
            return f"dtype {q.dtype}: fla's kernels take float32, bfloat16 or float16"
        if q.dim() != 4 or q.shape[1] == 0:
            return "an empty or malformed sequence (the native op handles it)"
        if op == "recurrent_gated_delta" and torch.is_grad_enabled() and any(
                isinstance(x, torch.Tensor) and x.requires_grad
                for x in (*args, *kwargs.values())):
            return "fla's fused recurrent gated delta rule has no backward"
        try:
            load()
        except ImportError as e:
            return f"flash-linear-attention does not import ({e}): pip install 'hyla[gpu]'"
        return None

    ops = {"chunk_gla": chunk_gla, "recurrent_gla": recurrent_gla,
           "chunk_gated_delta": chunk_gated_delta, "recurrent_gated_delta": recurrent_gated_delta}
    return Backend(name, ops, supports, priority)


def _h0(initial_state):
    return None if initial_state is None else initial_state.float()


def _cu(cu_seqlens, q):
    return None if cu_seqlens is None else cu_seqlens.to(q.device, torch.long)


def _finish(o, ht, q, initial_state, output_final_state, inplace):
    ht = None if ht is None else ht.float()
    ht = write_back(initial_state, ht, inplace)
    return o.to(q.dtype), (ht if output_final_state else None)


FLA_BACKEND = make_fla_backend()
