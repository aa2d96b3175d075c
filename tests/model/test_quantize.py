"""Weight-only int8 / int4 quantisation (hyla.model.quantize)."""

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.int4_packing import int4_fits, int4_layout_known
from hyla.model.quantize import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    WeightOnlyLinear,
    _dense_in_bf16,
    one_row_products,
    prepare_copies,
    quantize_model,
)
from hyla.model.vnni_int8 import int8_products_available, vnni_int8_available


def test_int8_linear_is_its_dequantised_weight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(3, 5, 64)
    want = x @ q.dequantized().T + lin.bias
    assert torch.allclose(q(x), want, atol=0.05, rtol=0.02)
    # and the dequantised weight is within half a step of the original
    step = lin.weight.abs().amax(1, keepdim=True) / 127
    assert ((q.dequantized() - lin.weight).abs() <= step * 0.51 + 1e-3).all()


def test_int4_takes_q4_blocks_exactly():
    # Weights already on a 4-bit grid per block of 32 (what a Q4_1 GGUF dequantises to)
    # survive re-quantisation: the output is x @ W up to bf16 activation rounding.
    torch.manual_seed(0)
    n, k, g = 64, 128, 32
    codes = torch.randint(0, 16, (n, k // g, g)).float()
    codes[..., 0], codes[..., 1] = 0, 15                     # each block spans its range
    d = (torch.rand(n, k // g, 1) * 0.1 + 0.01).bfloat16().float()
    m = (torch.randn(n, k // g, 1) * 0.1).bfloat16().float()
    w = (codes * d + m).view(n, k)
    q = Int4Linear(w, None, g)
    x = torch.randn(4, k)
    want = x.bfloat16().float() @ w.T
    assert torch.allclose(q(x), want, atol=0.05 * want.abs().max().item())
    assert torch.allclose(q.dequantized(), w, atol=1e-2 * w.abs().max().item())


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_prefill_rows_take_the_dense_path_with_the_same_weights(cls):
    # A few rows go through torch's packed kernel, many through the dequantised weight (in
    # bf16 where bf16 is fast): both compute the same product up to bf16 rounding.
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 192, bias=False)
    q = cls(lin.weight, None)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 128)
    few = torch.cat([q(x[i:i + 1]) for i in range(len(x))])
    many = q(x)
    assert torch.allclose(few, many, atol=0.02 * many.abs().max().item())
    assert torch.allclose(many, x @ q.dequantized().T, atol=0.02 * many.abs().max().item())


def test_the_int4_packing_is_the_one_unpacked():
    assert int4_layout_known()


def test_int4_falls_back_to_int8_where_the_kernel_cannot():
    assert int4_fits(torch.empty(64, 128))
    assert not int4_fits(torch.empty(64, 40)) and not int4_fits(torch.empty(48, 128))
    model = HylaLM(preset("debug")).eval()
    report = quantize_model(model, "int4")
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Int4Linear", "Int8Linear", "Int8Embedding"} <= kinds
    assert 0 < report.int4_layers < report.layers
    # the output layer keeps 8 bits: per row for fbgemm's VNNI products, else in groups
    assert isinstance(model.lm_head, Int8Linear if int8_products_available()
                      else Int8GroupLinear)
    assert "Linear" not in kinds and "Embedding" not in kinds


# Relative RMS error of the logits of a random debug model (the real cost, in perplexity on
# SmolLM2, is measured by benchmarks/quantize.py).
@pytest.mark.parametrize("scheme, tol", [("int8", 0.05), ("int4", 0.4)])
def test_quantised_model_decodes_like_itself_and_near_the_original(scheme, tol):
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    ids = torch.randint(0, 256, (10,))
    ref = model(ids[None])[0]
    report = quantize_model(model, scheme)
    assert report.bytes_after < report.bytes_before / 2.5
    full = model(ids[None])[0]
    assert (full - ref).norm() < tol * ref.norm()
    # prefill + decode through the quantised layers agrees with the full forward
    st = model.new_state()
    model.prefill(ids[:7], st)
    step = model.decode(ids[7:8], [st])
    assert torch.allclose(step[0], full[7], atol=1e-2)
    assert not any(p.requires_grad for p in model.parameters())


def test_bad_scheme_and_device_are_named():
    model = HylaLM(preset("debug"))
    with pytest.raises(ValueError, match="int3"):
        quantize_model(model, "int3")
    from hyla.model.quantize import _check_device
    with pytest.raises(ValueError, match="int4.*CPU only.*cuda"):
        _check_device("int4", torch.device("cuda"))
    assert quantize_model(model, "none").layers == 0


@pytest.mark.parametrize("k", [8, 24, 40, 100, 128])
def test_int8_is_right_for_input_sizes_the_kernel_gets_wrong(k):
    # torch's int8 kernel returns inf / 1e27 for input sizes not a multiple of 16
    torch.manual_seed(0)
    q = Int8Linear(torch.randn(64, k), None)
    x = torch.randn(1, k)
    want = x @ q.dequantized().T
    assert torch.allclose(q(x), want, atol=0.05 * want.abs().max().item())


def test_int8_in_groups_is_8_bits_through_two_int4_passes():
    torch.manual_seed(0)
    w = torch.randn(128, 96) * torch.rand(128, 1)           # rows of different ranges
    q = Int8GroupLinear(w, None)
    step = (w.view(128, 3, 32).amax(-1) - w.view(128, 3, 32).amin(-1)) / 255
    err = (q.dequantized() - w).view(128, 3, 32).abs().amax(-1)
    assert (err <= 0.52 * step + 1e-6).all()                # half a step of 8 bits
    x = torch.randn(3, 96)
    want = x.bfloat16().float() @ q.dequantized().T
    assert torch.allclose(q(x), want, atol=0.01 * want.abs().max().item())
    assert (q(x) - x @ w.T).norm() < 0.01 * (x @ w.T).norm()


def test_prepare_copies_makes_ahead_what_first_use_would_make():
    torch.manual_seed(0)
    lazy = HylaLM(preset("debug")).eval()
    model = HylaLM(preset("debug")).eval()
    model.load_state_dict(lazy.state_dict())
    quantize_model(lazy, "int4")
    quantize_model(model, "int4")
    ids = torch.randint(0, 256, (1, KERNEL_MAX_ROWS + 5))
    before = lazy(ids), lazy(ids[:, :5])            # copies made on first use
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    assert prepare_copies(model) == len(layers)    # the same, made ahead
    dense = _dense_in_bf16() and int4_layout_known()
    # not the output layer's: prompts need its logits at their last rows alone
    assert all(("_dense_bf16" in m.__dict__) == (dense and m is not model.lm_head)
               for m in layers)
    # the int8 copy only where forward takes it (without VNNI, int4 layers' never are)
    lazy_layers = [m for m in lazy.modules() if isinstance(m, WeightOnlyLinear)]
    made = [("_vnni" in m.__dict__) for m in layers]
    assert made == [("_vnni" in m.__dict__) for m in lazy_layers]
    assert made == [int8_products_available() and m.int8_products_from() <= KERNEL_MAX_ROWS
                    for m in layers]
    after = model(ids), model(ids[:, :5])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.skipif(not vnni_int8_available(), reason="8-bit activations need VNNI")
def test_eight_bit_activations_keep_no_16_bit_copy_of_int4_layers():
    """-a8: fbgemm takes decode batches alone, on the rotated 8-bit copy; prompts' rows run on
    the layer's own weights, so the 16-bit fbgemm copy is never made."""
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    quantize_model(model, "int4-a8")
    ids = torch.randint(0, 256, (1, 5))
    prompt = model(ids)
    prepare_copies(model)
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert int4 and not any("_vnni" in m.__dict__ for m in int4)
    assert all("_vnni8" in m.__dict__ for m in int4)
    assert torch.equal(model(ids), prompt)
    step = model(ids[0, :4, None])                   # a decode batch: 4 rows of one token
    assert torch.isfinite(step).all() and not any("_vnni" in m.__dict__ for m in int4)


def test_a_tied_output_layer_and_embedding_share_their_int8_codes():
    cfg = preset("debug")
    cfg.tie_embeddings = True
    model = HylaLM(cfg).eval()
    quantize_model(model, "int4")
    if isinstance(model.lm_head, Int8Linear):         # per row (VNNI): the embedding's codes
        assert model.lm_head.qweight.data_ptr() == model.embed.qweight.data_ptr()
    ids = torch.randint(0, 256, (1, 6))
    assert torch.isfinite(model(ids)).all()


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-a8", "int8-a8"])
def test_one_row_products_compute_each_row_of_a_batch_as_it_alone(scheme):
    """Speculation's batched verify: within one_row_products, every row of a decode batch
    ([B, 1, in], which otherwise takes fbgemm's batch products, 8-bit with "-a8") is bitwise
    what that row gives alone, for every quantised layer (and the whole model), at the
    widths a verify takes; the flag is off again after the block."""
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    quantize_model(model, scheme)
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    assert layers
    for width in (2, 4, 8, 16):
        for m in layers:
            x = torch.randn(width, 1, m.in_features)
            alone = torch.cat([m(x[i:i + 1]) for i in range(width)])
            with one_row_products():
                assert torch.equal(m(x), alone), (type(m).__name__, width)
    ids = torch.randint(0, 256, (8, 1))
    alone = torch.cat([model(ids[i:i + 1]) for i in range(8)])
    with one_row_products():
        assert torch.equal(model(ids), alone)
    if vnni_int8_available() and scheme.endswith("-a8"):   # the batch's own products
        assert not torch.equal(model(ids), alone)
