"""Mamba-2's SSD: the chunked form and the decode step against the fp64 token loop, outputs,
final states and every gradient; packed sequences; bad input named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyla.ops.ssd import chunk_ssd, naive_ssd, ssd_decode_step


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(B, T, H, P, G, N, dtype=torch.float32, harsh=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    dt = F.softplus(r(B, T, H)) * (8.0 if harsh else 1.0)        # harsh: -20 a step and more
    A = -torch.rand(H, generator=g, dtype=torch.float64) * (4.0 if harsh else 1.0)
    return [t.to(dtype) for t in (r(B, T, H, P), dt, A, r(B, T, G, N), r(B, T, G, N), r(H))]


SHAPES = [  # B, T, H, P, G, N
    pytest.param((1, 1, 2, 4, 1, 8), id="T1"),
    pytest.param((2, 63, 4, 8, 2, 16), id="B2-T63-G2"),
    pytest.param((1, 130, 6, 16, 3, 32), id="T130-G3"),
    pytest.param((2, 1000, 4, 8, 1, 16), id="B2-T1000"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("harsh", [False, True], ids=["mild", "harsh"])
def test_chunk_matches_the_fp64_loop_outputs_and_states(shape, harsh):
    B, T, H, P, G, N = shape
    x, dt, A, Bm, Cm, D = inputs(*shape, dtype=torch.float64, harsh=harsh)
    s0 = torch.randn(B, H, P, N, dtype=torch.float64)
    want, want_s = naive_ssd(x, dt, A, Bm, Cm, D, s0, output_final_state=True)
    got, got_s = chunk_ssd(*(t.float() for t in (x, dt, A, Bm, Cm, D)), s0.float(),
                           output_final_state=True, chunk_size=32)
    assert got.dtype == torch.float32 and got_s.dtype == torch.float32
    assert rel(got, want) < 1e-5 and rel(got_s, want_s) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_in_16_bits_within_5e_3(dtype):
    x, dt, A, Bm, Cm, D = inputs(2, 200, 4, 16, 2, 16)
    want, want_s = naive_ssd(x.double(), dt.double(), A.double(), Bm.double(), Cm.double(),
                             D.double(), output_final_state=True)
    got, got_s = chunk_ssd(x.to(dtype), dt, A, Bm.to(dtype), Cm.to(dtype), D,
                           output_final_state=True)
    assert got.dtype == dtype
    ref, ref_s = naive_ssd(x.to(dtype), dt, A, Bm.to(dtype), Cm.to(dtype), D,
                           output_final_state=True)         # the loop on the rounded inputs
    assert rel(got, ref) < 5e-3 and rel(got_s, ref_s) < 5e-3
    assert rel(got, want) < 2e-2                            # and near the exact one


def test_every_gradient_matches_the_loop():
    x, dt, A, Bm, Cm, D = inputs(1, 45, 4, 8, 2, 8, dtype=torch.float64)
    s0 = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, Bm, Cm, D, s0)]
    y, s = naive_ssd(*leaves[:6], leaves[6], output_final_state=True)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    want = torch.autograd.grad((y * dy).sum() + (s * ds).sum(), leaves)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y, s = chunk_ssd(*leaves[:6], leaves[6], output_final_state=True, chunk_size=16)
    got = torch.autograd.grad((y * dy).sum() + (s * ds).sum(), leaves)
    for name, g_, w in zip(("x", "dt", "A", "B", "C", "D", "state"), got, want, strict=True):
        assert rel(g_, w) < 1e-9, name


def test_packed_documents_reset_the_state_and_equal_separate_runs():
    cu = torch.tensor([0, 20, 20, 97, 150])
    x, dt, A, Bm, Cm, D = inputs(1, 150, 4, 8, 1, 5)
    s0 = torch.randn(4, 4, 8, 5)
    want, want_s = naive_ssd(x, dt, A, Bm, Cm, D, s0, True, cu)
    got, got_s = chunk_ssd(x, dt, A, Bm, Cm, D, s0, True, cu, chunk_size=16)
    assert rel(got, want) < 1e-5 and rel(got_s, want_s) < 1e-5
    one, one_s = chunk_ssd(x[:, 20:97], dt[:, 20:97], A, Bm[:, 20:97], Cm[:, 20:97], D,
                           s0[2:3], True)
    assert rel(got[:, 20:97], one) < 1e-6 and rel(got_s[2:3], one_s) < 1e-6


def test_prefill_then_decode_steps_equal_one_pass():
    x, dt, A, Bm, Cm, D = inputs(2, 40, 4, 8, 2, 16)
    want, want_s = chunk_ssd(x, dt, A, Bm, Cm, D, output_final_state=True)
    _, state = chunk_ssd(x[:, :30], dt[:, :30], A, Bm[:, :30], Cm[:, :30], D,
                         output_final_state=True)
    steps = [ssd_decode_step(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D, state)
             for t in range(30, 40)]
    assert rel(torch.stack(steps, 1), want[:, 30:]) < 1e-5 and rel(state, want_s) < 1e-5


@pytest.mark.parametrize("change,needle", [
    (lambda a: a.__setitem__(1, -a[1]), "dt is a step size and must be >= 0"),
    (lambda a: a.__setitem__(2, -a[2]), "A must be <= 0"),
    (lambda a: (a.__setitem__(3, a[3][:, :, :1].repeat(1, 1, 3, 1)),
                a.__setitem__(4, a[4][:, :, :1].repeat(1, 1, 3, 1))),
     "multiple of the groups G=3"),
    (lambda a: a.__setitem__(4, a[4][..., :3]), "B and C must have one shape"),
    (lambda a: a.__setitem__(5, a[5][:2]), r"D must be \[H\]"),
    (lambda a: a.__setitem__(0, a[0].long()), "x must be a floating-point"),
])
def test_bad_input_is_named(change, needle):
    args = inputs(1, 8, 4, 2, 2, 4)
    change(args)
    with pytest.raises(ValueError, match=needle):
        chunk_ssd(*args)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_ssd(*inputs(1, 8, 4, 2, 2, 4), initial_state=torch.zeros(1, 4, 4, 2))
