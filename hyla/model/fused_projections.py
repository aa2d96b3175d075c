"""Sibling projections of one input (q, k, v; gate, up) as one weight-only matmul.

A decode step of a small quantised model costs more in per-call work than in bytes: each
quantised matmul converts its input to bf16, runs a kernel and converts back (about 20 us
a call on SmolLM2's shapes, against 10-60 us of kernel). Projections that always read the
same tensor are concatenated into one quantised weight, registered on their parent as
``fused_<names>``; each keeps its name and slot, so the model code is unchanged, and
returns its slice of the shared product, computed once per input tensor.

The product is cached for the tensor it was computed from (by identity) until each sibling
has taken its slice; a sibling called with another tensor recomputes it (correct, only
slower: ``SharedProduct.recomputed`` counts those, and the tests keep it at zero for every
mixer). Inference only, like the quantised layers it holds.
"""

from __future__ import annotations

import torch
from torch import nn

# Names that, in every mixer and FFN here, project the same input.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Cached:
    """The product of the last input: plain attributes (nn.Module's __setattr__, three
    writes a call, was the fourth-largest Python cost of a SmolLM2 decode step profiled)."""

    __slots__ = ("input", "parts", "left")

    def __init__(self):
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.left = 0                  # bit i: sibling i has not taken its slice yet


class SharedProduct(nn.Module):
    """One linear layer whose output is the siblings' outputs side by side."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self.recomputed = 0            # products computed again for a sibling's other input
        self.cached = _Cached()
        self.traced = _Cached()        # what torch.compile traces through (see part)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        # A compiled step has a cache of its own: it replays its writes to the cache after
        # each run, which would clobber an eager step's on another thread (a graph is built
        # in the background while the engine thread serves eagerly).
        c = self.traced if torch.compiler.is_compiling() else self.cached
        if x is not c.input or not (c.left >> i) & 1:
            if c.left:
                self.recomputed += 1
            # the C++ method: Tensor.split's Python wrapper was 6% of a step under py-spy
            c.parts = self.linear(x).split_with_sizes(self.sizes, dim=-1)
            c.input, c.left = x, (1 << len(self.sizes)) - 1
        c.left &= ~(1 << i)
        out = c.parts[i]
        if not c.left:                 # all taken: hold nothing between calls
            c.input, c.parts = None, ()
        return out


class SharedSlice(nn.Module):
    """A sibling projection: its slice of a :class:`SharedProduct`."""

    def __init__(self, product: SharedProduct, index: int, in_features: int,
                 out_features: int):
        super().__init__()
        # a plain reference: the product is registered once, on the parent
        self.__dict__["product"] = product
        self.index, self.in_features, self.out_features = index, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.part(x, self.index)


def fuse_siblings(parent: nn.Module, make, concat=torch.cat) -> int:
    """Replace each group of :data:`SIBLINGS` on ``parent`` (plain ``nn.Linear`` layers of
    one input size) by slices of one layer ``make(weight, bias)``, its weight and bias the
    siblings' joined by ``concat``. Returns how many linear layers were fused."""
    fused = 0
    for names in SIBLINGS:
        layers = [getattr(parent, n, None) for n in names]
        if not all(type(m) is nn.Linear for m in layers):
            continue
        if len({m.in_features for m in layers}) != 1:
            continue
        weight = concat([m.weight.detach() for m in layers])
        bias = None
        if any(m.bias is not None for m in layers):
            bias = concat([m.bias.detach() if m.bias is not None
                           else weight.new_zeros(m.out_features) for m in layers])
        product = SharedProduct(make(weight, bias), [m.out_features for m in layers])
        parent.register_module("fused_" + "_".join(n.removesuffix("_proj") for n in names),
                               product)
        for i, (name, m) in enumerate(zip(names, layers, strict=True)):
            setattr(parent, name, SharedSlice(product, i, m.in_features, m.out_features))
        fused += len(layers)
    return fused
