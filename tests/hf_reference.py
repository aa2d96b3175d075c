"""transformers' own hybrid-family classes on their pure-PyTorch path, for the family tests.

transformers picks a family's kernels (flash-linear-attention, causal-conv1d) when its
modeling module is imported; on a CPU they must not be picked. ``reference(name)`` imports
(or re-imports) ``transformers.models.<name>.modeling_<name>`` with those packages hidden,
and gives the module back.
"""

from __future__ import annotations

import importlib
import sys

HIDDEN = ("fla", "causal_conv1d")


def reference(name: str):
    """The modeling module of family ``name`` (e.g. ``"qwen3_next"``) on the torch path."""
    module_name = f"transformers.models.{name}.modeling_{name}"
    saved = {k: sys.modules.get(k) for k in HIDDEN}
    for k in HIDDEN:
        sys.modules[k] = None
    try:
        sys.modules.pop(module_name, None)
        return importlib.import_module(module_name)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
