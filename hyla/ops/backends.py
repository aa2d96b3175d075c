"""Kernel backends behind the linear-attention ops: one registry, one selection rule.

The public ops (``hyla.ops.gla.chunk_gla``, ``recurrent_gla``, ``hyla.ops.deltanet.
chunk_gated_delta``, ``recurrent_gated_delta``) are dispatchers: each call picks a backend
and runs that backend's implementation of the op, which has hyla's signature and contract
(DESIGN.md, "Op contracts"). Two backends ship:

- ``"native"``: hyla's plain-PyTorch ops; any device, any dtype; the default on CPU.
- ``"fla"``: flash-linear-attention's Triton kernels (``pip install "hyla[gpu]"``) through
  :mod:`hyla.ops.fla_backend`, which translates hyla's conventions into fla's; chosen on CUDA
  tensors in fp32/bf16/fp16 when ``fla`` imports.

Selection, per call: the ``backend=`` argument if given, else the environment variable
``HYLA_OPS_BACKEND`` (``native``, ``fla`` or ``auto``), else ``auto``: the registered backend
of highest priority whose ``supports(op, args, kwargs)`` says yes (``native`` supports
everything, at the lowest priority). A forced backend that cannot run the call is a
``ValueError`` saying why, never a silent fallback. Tests register their own backends
(:func:`register_backend`) to check the selection on a CPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from hyla.ops.backend_base import Backend

ENV_VAR = "HYLA_OPS_BACKEND"
OPS = ("chunk_gla", "recurrent_gla", "chunk_gated_delta", "recurrent_gated_delta")


_BACKENDS: dict[str, Backend] = {}
NATIVE = Backend("native", priority=-1)


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend under its name.

    Example:
        >>> calls = []
        >>> fake = Backend("fake", {"chunk_gla": lambda *a, **kw: calls.append(kw)},
        ...                supports=lambda op, a, kw: None, priority=100)
        >>> register_backend(fake); select("chunk_gla", (), {})
        'fake'
        >>> unregister_backend("fake"); select("chunk_gla", (), {})
        'native'
    """
    if not backend.name or backend.name == "auto":
        raise ValueError(f"backend name must be non-empty and not 'auto', got {backend.name!r}")
    _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    if name == "native":
        raise ValueError("the native backend cannot be removed")
    _BACKENDS.pop(name, None)


def backends() -> list[str]:
    """Registered backend names, highest priority first."""
    _ensure_builtin()
    return [b.name for b in sorted(_BACKENDS.values(), key=lambda b: -b.priority)]


def select(op: str, args: tuple, kwargs: dict, backend: str | None = None) -> str:
    """The backend that runs ``op(*args, **kwargs)``: forced (argument, then environment)
    or the first that supports it by priority."""
    _ensure_builtin()
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    name = backend if backend is not None else os.environ.get(ENV_VAR) or "auto"
    if name != "auto":
        b = _BACKENDS.get(name)
        if b is None:
            source = "backend" if backend is not None else ENV_VAR
            raise ValueError(f"{source} must be 'auto' or one of {backends()}, got {name!r}")
        if op not in b.ops:
            raise ValueError(f"backend {name!r} has no {op}")
        why = b.supports(op, args, kwargs)
        if why is not None:
            raise ValueError(f"backend {name!r} cannot run this {op} call: {why}")
        return name
    for b in sorted(_BACKENDS.values(), key=lambda b: -b.priority):
        if op in b.ops and b.supports(op, args, kwargs) is None:
            return b.name
    return "native"


def implementation(op: str, name: str) -> Callable:
    _ensure_builtin()
    return _BACKENDS[name].ops[op]


def dispatched(op: str, native: Callable) -> Callable:
    """The public form of a native op: same signature plus ``backend=``, dispatching."""
    NATIVE.ops[op] = native

    @functools.wraps(native)
    def op_fn(*args, backend: str | None = None, **kwargs):
        name = select(op, args, kwargs, backend)
        return _BACKENDS[name].ops[op](*args, **kwargs)

    op_fn.native = native
    return op_fn


@functools.cache
def _ensure_builtin() -> None:
    _BACKENDS.setdefault("native", NATIVE)
    # Registered on first use, not at import: the fla module imports nothing heavy until
    # a CUDA call asks for it.
    from hyla.ops.fla_backend import FLA_BACKEND

    _BACKENDS.setdefault("fla", FLA_BACKEND)
