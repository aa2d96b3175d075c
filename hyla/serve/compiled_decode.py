"""The runner's decode step through ``torch.compile``: one graph a shape, built on first
use (importing the compiler takes 2-3 s, which a server building its graphs in the
background spends after it is healthy, not before).

The model is frozen while it serves, so guards on its modules' attributes are skipped:
checking them on each call cost 1.4 ms of a 15 ms SmolLM2 step; the shapes stay guarded.
Without those guards, graphs built for another runner's model would match this one's
calls, so each runner's calls carry a number of its own (``graph_key``, an int argument,
guarded by value). torch 2.13's filter fails on some models whose step breaks the graph
(``KeyError`` naming a module attribute; found: MiMo-V2-Flash's MoE stack):
:func:`compile_decode` with ``skip_module_guards=False`` builds with every guard instead.
"""

from __future__ import annotations

import itertools

import torch

_RUNNER_KEYS = itertools.count()       # what tells compiled runners' graphs apart


def compile_decode(decode_impl, model, *, skip_module_guards: bool = True):
    """``fn(*args, one_row=False)``: ``decode_impl(*args, graph_key=...)`` compiled, a
    verify in one-row products (``one_row_products``) a graph of its own."""
    from torch import _dynamo

    if getattr(model, "quantized", None):
        # The quantised layers' copies made now, not first made inside a trace: a graph
        # would name an fbgemm weight that the trace made and dropped (found: KeyError in
        # vnni_int8_linear with two compiled engines).
        from hyla.model.quantize import prepare_copies

        prepare_copies(model)
    # Each decode shape is its own graph; the default limit (8) would fall back to eager
    # silently once more shapes were seen.
    _dynamo.config.recompile_limit = 1024
    _dynamo.config.accumulated_recompile_limit = 4096
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} \
        if skip_module_guards else {}
    compiled = torch.compile(decode_impl, dynamic=False, options=options)
    key = 2 * next(_RUNNER_KEYS)
    return lambda *a, one_row=False: compiled(*a, graph_key=key + one_row)
