"""Weights checked to be finite when a model loads: a checkpoint with one NaN or inf would
otherwise serve as healthy (greedy requests answering garbage, sampled ones failing).

:func:`load_model` refuses such a model with a ValueError naming each bad tensor; pass
``allow_nonfinite=True`` (``--allow-nonfinite`` on the CLI) to load it anyway, to inspect it.

Example:
    >>> import torch
    >>> check_finite({"w": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}, "ckpt")
    Traceback (most recent call last):
    ...
    ValueError: ckpt has non-finite weights in 1 tensor(s): b (1 NaN, 0 inf); ...
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

import torch


def nonfinite_tensors(tensors) -> list[tuple[str, int, int]]:
    """``(name, NaN count, inf count)`` of every floating tensor of ``tensors`` (a model or a
    dict of name -> tensor) that holds a non-finite value; one pass over each tensor (its
    sum; the exact counts are made only for the bad ones)."""
    if isinstance(tensors, torch.nn.Module):
        tensors = dict(tensors.named_parameters()) | dict(tensors.named_buffers())
    bad = []
    with torch.no_grad():
        for name, t in tensors.items():
            if not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta":
                continue
            # A finite sum means every element is finite (a NaN or inf anywhere makes the sum
            # non-finite); only a non-finite sum (or an overflow) needs the exact check.
            if bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
                continue
            nan = int(torch.isnan(t).sum())
            bad.append((name, nan, int((~torch.isfinite(t)).sum()) - nan))
    return bad


def check_finite(tensors, what: str = "the model", allow: bool = False) -> None:
    """ValueError naming the tensors of ``tensors`` that hold a NaN or an inf (at most 8
    named); with ``allow``, a warning on stderr instead."""
    bad = nonfinite_tensors(tensors)
    if not bad:
        return
    named = ", ".join(f"{n} ({nan} NaN, {inf} inf)" for n, nan, inf in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    if allow:
        print(f"warning: {what} has non-finite weights in {len(bad)} tensor(s): {named}{more}"
              f" (loaded anyway: --allow-nonfinite)", file=sys.stderr)
        return
    raise ValueError(f"{what} has non-finite weights in {len(bad)} tensor(s): {named}{more}; "
                     f"it would serve garbage. Load it with --allow-nonfinite "
                     f"(allow_nonfinite=True) only to inspect it")


_ALLOW = contextvars.ContextVar("allow_nonfinite", default=False)


@contextlib.contextmanager
def allowing_nonfinite(allow: bool = True):
    """Within the block, loads take non-finite weights with a warning (what
    ``--allow-nonfinite`` sets around a whole CLI command, wherever it loads models)."""
    token = _ALLOW.set(bool(allow))
    try:
        yield
    finally:
        _ALLOW.reset(token)


def finite_weights(load):
    """Decorator for a ``load(source, ...) -> (model, ...)`` function: the loaded model's
    weights are checked by :func:`check_finite`; the wrapped function takes an extra
    keyword ``allow_nonfinite`` (default: False, or True inside :func:`allowing_nonfinite`)."""
    @functools.wraps(load)
    def wrapper(source, *args, allow_nonfinite: bool | None = None, **kwargs):
        result = load(source, *args, **kwargs)
        allow = _ALLOW.get() if allow_nonfinite is None else allow_nonfinite
        check_finite(result[0], f"model source {str(source)!r}", allow=allow)
        return result
    return wrapper
