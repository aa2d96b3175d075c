"""Sibling projections fused into one quantised matmul (hyla.model.fused_projections)."""

import copy
import dataclasses

import pytest
import torch

from hyla.model import HylaLM, fused_projections, preset
from hyla.model.fused_projections import SharedProduct, SharedSlice
from hyla.model.quantize import quantize_model

LAYOUTS = [("debug", {}), ("debug", {"layers": "GDKA"}), ("debug-moe", {}),
           ("debug", {"layers": "GGAD", "linear_window": 4, "window_sinks": 1})]


def _logits(model, ids):
    st = model.new_state()
    head = model.prefill(ids[:-3], st)
    steps = [model.decode(ids[i:i + 1], [st])[0] for i in range(len(ids) - 3, len(ids))]
    return head, torch.stack(steps)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name, changes", LAYOUTS)
def test_fused_model_computes_what_the_unfused_one_does(name, changes, scheme, monkeypatch):
    torch.manual_seed(0)
    base = HylaLM(dataclasses.replace(preset(name), **changes)).eval()
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model(fused, scheme)
    monkeypatch.setattr(fused_projections, "SIBLINGS", ())
    quantize_model(plain, scheme)
    products = [m for m in fused.modules() if isinstance(m, SharedProduct)]
    assert products and not any(isinstance(m, SharedProduct) for m in plain.modules())
    ids = torch.randint(0, base.cfg.vocab_size, (12,))
    for a, b, ref in zip(_logits(fused, ids), _logits(plain, ids), _logits(base, ids),
                         strict=True):
        if scheme == "int8":    # rows are quantised alike, fused or not: the same numbers
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        else:   # a fused weight may fit the int4 kernel where a sibling alone did not
            assert (a - ref).norm() < 0.4 * ref.norm()
    # every sibling read the tensor the product was computed from: nothing computed twice,
    # and nothing held once the step is over
    assert all(p.recomputed == 0 and p.cached.input is None for p in products)


def test_a_sibling_called_with_another_input_recomputes_and_stays_right():
    torch.manual_seed(0)
    lin = [torch.nn.Linear(64, n) for n in (64, 32)]
    product = SharedProduct(torch.nn.Linear(64, 96), [64, 32])
    with torch.no_grad():
        product.linear.weight.copy_(torch.cat([m.weight for m in lin]))
        product.linear.bias.copy_(torch.cat([m.bias for m in lin]))
    a, b = SharedSlice(product, 0, 64, 64), SharedSlice(product, 1, 64, 32)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    with torch.no_grad():
        assert torch.allclose(a(x), lin[0](x), atol=1e-6)
        assert torch.allclose(b(y), lin[1](y), atol=1e-6)     # not x's product
        assert product.recomputed == 1
        assert torch.allclose(b(y), lin[1](y), atol=1e-6)     # b twice: computed again
        assert product.recomputed == 2
        assert torch.allclose(a(y), lin[0](y), atol=1e-6)     # then a takes its slice
        assert product.recomputed == 2 and product.cached.input is None
    # registered once, on the parent: one copy in the state dict
    parent = torch.nn.Module()
    parent.fused = product
    parent.q_proj = a
    assert sum(k.endswith("linear.weight") for k in parent.state_dict()) == 1
