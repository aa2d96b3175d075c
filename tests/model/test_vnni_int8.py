"""fbgemm's int8 products for decode rows (hyla.model.vnni_int8) and where quantize uses them:
with VNNI on an 8-bit activation grid, on any AVX2 CPU on a 7-bit one (``levels=127``, which
a VNNI CPU runs too, so both grids are checked wherever fbgemm runs)."""

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model import quantize as Q
from hyla.model.vnni_int8 import (
    VnniInt8Matmul,
    int8_products_available,
    per_row_int8,
    vnni_int8_available,
)

needs_vnni = pytest.mark.skipif(not vnni_int8_available(),
                                reason="8-bit activations need x86 with AVX512-VNNI")
needs_fbgemm = pytest.mark.skipif(not int8_products_available(),
                                  reason="fbgemm's int8 products need x86 with AVX2")
LEVELS = [127, pytest.param(255, marks=needs_vnni)]


def _rows_with_outliers(m: int, k: int) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(m, k)
    x[:, 7] *= 40                    # an outlier channel, as LLM activations have
    x[1] *= 8                        # rows of very different ranges
    x[2] += 3                        # and one far from zero
    return x


@needs_fbgemm
@pytest.mark.parametrize("levels", LEVELS)
def test_error_is_the_8_bit_weight_alone(levels):
    # activations at ~16 bits (~14 on the 7-bit grid: a row and its residual), so the error
    # is the weight's: against the product with the int8 weight itself, far below 8-bit
    # activations' ~2%
    torch.manual_seed(0)
    w = torch.randn(512, 256)
    mm = VnniInt8Matmul(*per_row_int8(w), levels=levels)
    x = _rows_with_outliers(6, 256)
    scale = w.abs().amax(1, keepdim=True) / 127
    w8 = (w / scale).round().clamp(-127, 127) * scale
    want = x @ w8.T
    # each row within 1e-3 of its own size (measured 2.8e-4 on the 7-bit grid)
    assert ((mm(x) - want).norm(dim=1) / want.norm(dim=1)).max() < 1e-3
    assert (mm(x) - x @ w.T).norm() < 0.01 * (x @ w.T).norm()


@needs_fbgemm
@pytest.mark.parametrize("levels", LEVELS)
def test_a_row_gets_the_same_result_alone_or_in_any_batch(levels):
    torch.manual_seed(0)
    mm = VnniInt8Matmul(*per_row_int8(torch.randn(256, 128)), levels=levels)
    x = _rows_with_outliers(16, 128)
    together = mm(x)
    alone = torch.cat([mm(x[i:i + 1]) for i in range(16)])
    assert torch.allclose(together, alone, rtol=1e-5, atol=1e-4)
    assert torch.allclose(mm(x[[3, 0]]), together[[3, 0]], rtol=1e-5, atol=1e-4)


@needs_fbgemm
@pytest.mark.parametrize("levels", LEVELS)
def test_constant_and_extreme_rows_stay_finite(levels):
    mm = VnniInt8Matmul(*per_row_int8(torch.randn(64, 32)), levels=levels)
    x = torch.stack([torch.full((32,), 2.5), torch.zeros(32), torch.randn(32) * 1e4])
    y = mm(x)
    assert torch.isfinite(y).all()
    want = x @ torch.ops.quantized.linear_unpack(mm.packed)[0].dequantize().T
    assert torch.allclose(y[:2], want[:2], atol=1e-4)     # span 0: min * (W 1) exactly
    assert (y[2] - want[2]).norm() < 1e-3 * want[2].norm()
    assert mm(x.bfloat16()).dtype is torch.float32        # takes bf16, answers fp32


def test_levels_are_127_or_255():
    with pytest.raises(ValueError, match="levels must be 127 or 255"):
        VnniInt8Matmul(*per_row_int8(torch.randn(8, 8)), levels=64)


@needs_fbgemm
def test_quantised_output_layer_decodes_through_it(monkeypatch):
    # the other layers from two rows (where VNNI and bf16 make torch's kernel as fast for
    # one; on AVX2 alone fbgemm_min_rows measures 1 and they take it from one row too)
    monkeypatch.setattr(Q, "fbgemm_min_rows", lambda: 2)
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    ids = torch.randint(0, 256, (10,))
    ref = model(ids[None])[0]
    Q.quantize_model(model, "int4")
    head = model.lm_head
    layers = [m for m in model.modules() if isinstance(m, Q.WeightOnlyLinear) and m is not head]
    st = model.new_state()
    model.prefill(ids[:1], st)
    # one row: the output layer takes fbgemm's products (its int8 codes, packed on first
    # use); the other layers keep their own kernel and make no int8 copy
    assert head.vnni_min_rows == 1 and isinstance(head.__dict__["_vnni"], VnniInt8Matmul)
    assert torch.equal(torch.ops.quantized.linear_unpack(head.__dict__["_vnni"].packed)[0]
                       .int_repr(), head.qweight)
    assert not any("_vnni" in m.__dict__ for m in layers)
    model.prefill(ids[1:7], st)           # 6 rows: they make it (requantised int4 codes:
    # with VNNI alone; on AVX2's 7-bit grid they keep their own kernel)
    assert all(("_vnni" in m.__dict__) == (vnni_int8_available() or m.exact_int8_rows)
               for m in layers)
    step = model.decode(ids[7:8], [st])[0]
    assert (step - ref[7]).norm() < 0.4 * ref[7].norm()       # int4's own bound
    two = model.decode(ids[7:9], [st, model.new_state()])
    assert torch.isfinite(two).all()


def test_without_fbgemm_the_weight_only_kernels_stay(monkeypatch):
    monkeypatch.setattr(Q, "int8_products_available", lambda: False)
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    ids = torch.randint(0, 256, (1, 6))
    Q.quantize_model(model, "int4")
    out = model(ids)
    assert torch.isfinite(out).all()
    assert not any("_vnni" in m.__dict__ for m in model.modules())


@needs_vnni
def test_8_bit_activations_need_the_rotation_on_outlier_channels():
    # one row alone (no residual) is 8-bit: an outlier channel leaves the others few levels;
    # rotated first (the weight alike), the error falls back near the 16-bit one's
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    x = _rows_with_outliers(6, 128)
    want = x @ w.T
    err = {name: ((mm(x) - want).norm() / want.norm()).item() for name, mm in [
        ("16", VnniInt8Matmul(*per_row_int8(w))),
        ("8", VnniInt8Matmul(*per_row_int8(w), residual=False)),
        ("8 rotated", VnniInt8Matmul.eight_bit(w))]}
    assert err["16"] < err["8 rotated"] < 0.75 * err["8"], err     # 0.5-0.7 over seeds
    assert err["8 rotated"] < 0.03, err
    # still one row's own range: a row's result does not depend on its batch
    mm = VnniInt8Matmul.eight_bit(w)
    assert torch.allclose(mm(x[2:3]), mm(x)[2:3], rtol=1e-5, atol=1e-4)


@needs_vnni
def test_eight_bit_keeps_16_bits_where_the_rotation_does_not_fit():
    w = torch.randn(64, 96)                     # 96 is not a multiple of the 64-wide block
    mm = VnniInt8Matmul.eight_bit(w)
    assert mm.residual and mm.rotation is None


@needs_vnni
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a8_schemes_decode_batches_through_rotated_8_bit_products(weights):
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    ids = torch.randint(0, 256, (2, 9))
    ref = HylaLM(preset("debug")).eval()
    ref.load_state_dict(model.state_dict())
    Q.quantize_model(ref, weights)
    Q.quantize_model(model, f"{weights}-a8")
    assert model.quantized == f"{weights}-a8"
    for m in ref.modules():
        if isinstance(m, Q.WeightOnlyLinear) and not m.exact_int8_rows:
            m.vnni_min_rows = Q.KERNEL_MAX_ROWS + 1         # its own weights for any rows
    logits, want = [], []
    for m, out in [(model, logits), (ref, want)]:
        states = [m.new_state(), m.new_state()]
        out.append([m.prefill(row[:8], s) for s, row in zip(states, ids, strict=True)])
        out.append(m.decode(ids[:, 8], states))      # two rows: fbgemm's products
    layers = [m for m in model.modules() if isinstance(m, Q.WeightOnlyLinear)]
    assert all(m.activation_bits == 8 for m in layers)
    rotated = [m.__dict__["_vnni8"] for m in layers if "_vnni8" in m.__dict__]
    assert rotated and all(v.rotation is not None and not v.residual for v in rotated)
    # a prompt's rows keep 16 bits, on the layers' own weights (the 16-bit fbgemm copy is
    # never made): the plain scheme's logits where it too keeps fbgemm off them
    assert not any("_vnni" in m.__dict__ for m in layers if not m.exact_int8_rows)
    assert all(torch.equal(a, b) for a, b in zip(logits[0], want[0], strict=True))
    # the decode batch: the same model's logits but for 8 bits of activations
    assert (logits[1] - want[1]).norm() < 0.05 * want[1].norm()
    assert not (logits[1] == want[1]).all()


def test_a8_without_vnni_is_refused_naming_the_scheme(monkeypatch):
    monkeypatch.setattr(Q, "vnni_int8_available", lambda: False)
    with pytest.raises(ValueError, match="int4-a8.*AVX512-VNNI.*--quantize int4"):
        Q.quantize_model(HylaLM(preset("debug")).eval(), "int4-a8")


@needs_fbgemm
def test_one_row_takes_fbgemm_where_it_measures_faster():
    """fbgemm_min_rows times both kernels on this CPU: an answer of 1 or 2, and the layers
    of a quantised model follow it for one row."""
    rows = Q.fbgemm_min_rows()
    assert rows in (1, 2)
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    Q.quantize_model(model, "int8")
    st = model.new_state()
    model.prefill(torch.randint(0, 256, (1,)), st)
    layers = [m for m in model.modules() if isinstance(m, Q.WeightOnlyLinear)
              and m is not model.lm_head]
    assert all(("_vnni" in m.__dict__) == (rows == 1) for m in layers)


@needs_fbgemm
def test_int8_codes_give_way_to_the_packed_copy_where_it_serves_every_row(monkeypatch):
    """Where fbgemm takes one row up and bf16 is slow (AVX2), an Int8Linear keeps one copy
    of its weight, fbgemm's: its codes, dense weight and outputs are unchanged."""
    monkeypatch.setattr(Q, "fbgemm_min_rows", lambda: 1)
    monkeypatch.setattr(Q, "_dense_in_bf16", lambda: False)
    torch.manual_seed(0)
    layer = Q.Int8Linear(torch.randn(96, 64), None)
    codes, dense = layer.qweight.clone(), layer.dequantized()
    x = torch.randn(Q.KERNEL_MAX_ROWS + 36, 64)         # the dense path, no copy made
    many = layer(x)
    layer.vnni_matmul()
    assert layer.qweight is None and "qweight" not in layer.state_dict()
    assert torch.equal(layer.int8_rows()[0], codes)
    assert torch.equal(layer.dequantized(), dense)
    assert torch.equal(layer(x), many)
    one = layer(x[:1])                                      # fbgemm's products
    assert (one - many[:1]).norm() < 1e-3 * many[:1].norm()
