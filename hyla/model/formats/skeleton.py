"""A model of a config on the meta device, built without running weight initialisation.

A loader builds the model on the meta device to check every shape before allocating, then
fills it from the file. Initialising meta tensors does nothing useful, and costs: ``normal_``
on a meta tensor goes through ``torch._refs``, whose first call imports ``torch._dynamo``
(1.5-4.5 s on a 2-core machine, more than the rest of a 135M GGUF load). Within
:func:`meta_model` the ``torch.nn.init`` functions skip meta tensors (and only those: any
other thread initialising real tensors meanwhile is unaffected).

Example:
    >>> from hyla.model import preset
    >>> meta_model(preset("debug")).embed.weight.is_meta
    True
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import nn

_INIT = ("normal_", "uniform_", "trunc_normal_", "constant_", "zeros_", "ones_",
         "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
         "orthogonal_", "eye_", "dirac_", "sparse_")
_lock = threading.Lock()


def _skip_meta(fn):
    @functools.wraps(fn)
    def init(tensor, *args, **kwargs):
        return tensor if getattr(tensor, "is_meta", False) else fn(tensor, *args, **kwargs)
    return init


@contextlib.contextmanager
def skip_meta_init():
    """Within the block, ``torch.nn.init``'s functions leave meta tensors alone."""
    with _lock:
        saved = {name: getattr(nn.init, name) for name in _INIT if hasattr(nn.init, name)}
        try:
            for name, fn in saved.items():
                setattr(nn.init, name, _skip_meta(fn))
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def meta_model(cfg):
    """``HylaLM(cfg)`` on the meta device, its initialisation skipped."""
    from hyla.model.model import HylaLM

    with skip_meta_init(), torch.device("meta"):
        return HylaLM(cfg)


def to_empty(model: nn.Module, device) -> nn.Module:
    """``model.to_empty(device=device)`` without ``torch.empty_like`` on meta tensors, whose
    first call imports sympy through ``torch._refs`` (about a second)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
