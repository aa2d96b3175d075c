"""StreamKL against the materialised reference in float64: value and every gradient."""

import pytest
import torch

from hyla.ops.streamkl import (
    AttentionKLLoss,
    attention_kl,
    chunk_attention_kl,
    naive_attention_kl,
)


def rel_rms(x, ref):
    ref = ref.double()
    return ((ref - x.double()).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-5 if dtype in (torch.float32, torch.float64) else 5e-3


def make_inputs(B, T, H, hkv_t, hkv_s, d_t, d_s, dtype, *, S=None, spread=1.0, seed=0):
    """Teacher and student share structure (the student is a noisy teacher), as in
    distillation, so the KL is O(1) rather than dominated by unrelated random scores."""
    S = T if S is None else S
    gen = torch.Generator().manual_seed(seed)
    q_t = torch.randn(B, T, H, d_t, generator=gen) * spread
    k_t = torch.randn(B, S, hkv_t, d_t, generator=gen) * spread
    q_s = torch.randn(B, T, H, d_s, generator=gen) * spread
    k_s = torch.randn(B, S, hkv_s, d_s, generator=gen) * spread
    return [x.to(dtype).requires_grad_() for x in (q_t, k_t, q_s, k_s)]


def run(fn, inputs, cot, **kw):
    """Value and gradients of sum(KL * cot) (cot: random per-row cotangent [B, H, T])."""
    kl = fn(*inputs, reduction="none", **kw)
    (kl.double() * cot).sum().backward()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return [kl.detach()] + grads


def reference(inputs, cot, **kw):
    """The specification on float64 copies of the (possibly low-precision) inputs."""
    fp64 = [x.detach().double().requires_grad_() for x in inputs]
    return run(naive_attention_kl, fp64, cot, **kw)


def compare(name, got, ref, dtype):
    for label, x, r in zip(["kl", "dq_t", "dk_t", "dq_s", "dk_s"], got, ref, strict=True):
        assert torch.isfinite(x.float()).all(), f"{name}: {label} not finite"
        if r.numel() == 0:   # no keys: empty key gradients
            assert x.shape == r.shape, f"{name}: {label} shape {tuple(x.shape)}"
            continue
        if r.abs().max() == 0:   # e.g. T = 1: one key, KL and gradients exactly 0
            assert x.abs().max() <= tol(dtype), f"{name}: {label} should be 0"
            continue
        err = rel_rms(x, r)
        assert err < tol(dtype), f"{name}: {label} rel RMS {err:.2e} >= {tol(dtype):.0e}"


def check(inputs, dtype, *, block_q, block_k, seed=1, **kw):
    B, T, H = inputs[0].shape[:3]
    cot = torch.randn(B, H, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = reference(inputs, cot, **kw)
    got = run(chunk_attention_kl, inputs, cot, block_q=block_q, block_k=block_k, **kw)
    compare("chunk", got, ref, dtype)


# B, T, H, H_kv teacher, H_kv student, D teacher, D student
SHAPES = [(2, 63, 4, 4, 4, 16, 16), (1, 130, 4, 2, 1, 32, 16), (1, 1, 2, 1, 2, 8, 8)]
SHAPE_IDS = ["B2-T63-H4-mha", "B1-T130-H4-gqa2/1-D32/16", "B1-T1"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_chunk_matches_naive(shape, dtype, causal):
    # Tiles of 32 x 48 keys: none of the lengths is a multiple, diagonal tiles are partial.
    check(make_inputs(*shape, dtype), dtype, causal=causal, block_q=32, block_k=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_ragged_T1000(dtype):
    check(make_inputs(1, 1000, 2, 1, 2, 16, 32, dtype), dtype, block_q=96, block_k=160)


@pytest.mark.parametrize("S", [40, 90, 0], ids=["S40<T", "S90>T", "S0"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_queries_and_keys_of_different_length(S, causal):
    """Causal with S < T leaves the first T - S rows fully masked: KL 0, no NaN."""
    inputs = make_inputs(2, 70, 2, 1, 2, 8, 8, torch.float32, S=S)
    check(inputs, torch.float32, causal=causal, block_q=16, block_k=32)
    kl = chunk_attention_kl(*inputs, causal=causal, reduction="none", block_q=16, block_k=32)
    if causal and S < 70:
        assert (kl[..., : 70 - S] == 0).all()


def test_fully_masked_rows_mean_and_grads_finite():
    q_t, k_t, q_s, k_s = make_inputs(1, 20, 2, 2, 2, 8, 8, torch.float32, S=5)
    loss = attention_kl(q_t, k_t, q_s, k_s, block_q=8, block_k=4)
    per_row = attention_kl(q_t, k_t, q_s, k_s, reduction="none")
    torch.testing.assert_close(loss, per_row[..., 15:].mean())   # rows 0..14 see no key
    loss.backward()
    assert all(torch.isfinite(x.grad).all() for x in (q_t, k_t, q_s, k_s))
    assert (q_s.grad[:, :15] == 0).all()
    empty = make_inputs(1, 6, 2, 2, 2, 8, 8, torch.float32, S=0)
    assert attention_kl(*empty, causal=False).item() == 0.0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_sequences(dtype, causal):
    cu = torch.tensor([0, 1, 64, 64, 130, 207])   # lengths 1, 63, 0, 66, 77
    inputs = make_inputs(1, 207, 4, 2, 4, 16, 8, dtype)
    check(inputs, dtype, causal=causal, cu_seqlens=cu, block_q=32, block_k=32)


def test_packed_equals_separate_sequences():
    q_t, k_t, q_s, k_s = (x.detach() for x in make_inputs(1, 90, 2, 1, 2, 8, 8, torch.float32))
    cu = torch.tensor([0, 40, 90])
    kl = chunk_attention_kl(q_t, k_t, q_s, k_s, cu_seqlens=cu, reduction="none", block_q=16)
    for s, e in [(0, 40), (40, 90)]:
        part = chunk_attention_kl(q_t[:, s:e], k_t[:, s:e], q_s[:, s:e], k_s[:, s:e],
                                  reduction="none", block_q=16)
        torch.testing.assert_close(kl[..., s:e], part, rtol=1e-5, atol=1e-6)


def test_different_scales():
    inputs = make_inputs(1, 50, 2, 2, 1, 16, 32, torch.float32)
    check(inputs, torch.float32, scale_t=0.7, scale_s=0.05, block_q=16, block_k=16)


def test_student_only_gradients():
    """A frozen teacher (no grad) gives the same student gradients, no teacher gradients."""
    q_t, k_t, q_s, k_s = make_inputs(1, 40, 2, 1, 2, 8, 8, torch.float32)
    q_t.requires_grad_(False), k_t.requires_grad_(False)
    attention_kl(q_t, k_t, q_s, k_s, block_q=16, block_k=16).backward()
    ref = [x.detach().double().requires_grad_() for x in (q_s, k_s)]
    naive_attention_kl(q_t.double(), k_t.double(), *ref).backward()
    assert q_t.grad is None and k_t.grad is None
    assert rel_rms(q_s.grad, ref[0].grad) < 1e-5 and rel_rms(k_s.grad, ref[1].grad) < 1e-5


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradcheck_fp64(causal):
    inputs = [x.detach().double().requires_grad_()
              for x in make_inputs(1, 11, 2, 1, 2, 4, 3, torch.float32, S=9)]

    def fn(*xs):
        return chunk_attention_kl(*xs, causal=causal, reduction="none", block_q=4, block_k=3)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_identical_teacher_and_student(dtype):
    q, k = (x.detach() for x in make_inputs(2, 77, 4, 2, 2, 16, 16, dtype)[:2])
    q_t, k_t = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_s, k_s = q.clone().requires_grad_(), k.clone().requires_grad_()
    kl = chunk_attention_kl(q_t, k_t, q_s, k_s, reduction="none", block_q=32, block_k=32)
    assert kl.abs().max().item() == 0.0
    kl.sum().backward()
    for x in (q_t, k_t, q_s, k_s):
        assert x.grad.abs().max().item() < 1e-6


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extreme_logits(causal):
    """Scores of about +-1e4: probabilities underflow to exact zeros, nothing overflows."""
    q_t, k_t, q_s, k_s = make_inputs(1, 40, 2, 1, 2, 4, 4, torch.float64, seed=3)
    with torch.no_grad():
        for x in (q_t, k_t, q_s, k_s):   # scores ~ +-1e4 with D = 4, scale 1/2
            x.copy_(x.sign() * 70.0)
    inputs = [x.detach().float().requires_grad_() for x in (q_t, k_t, q_s, k_s)]
    got = chunk_attention_kl(*inputs, causal=causal, reduction="none", block_q=16, block_k=16)
    assert got.abs().max() > 1e3   # genuinely extreme
    check(inputs, torch.float32, causal=causal, block_q=16, block_k=16)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("backend", ["chunk", "naive"])
def test_reductions_and_loss_module(reduction, backend):
    inputs = [x.detach() for x in make_inputs(2, 30, 2, 1, 2, 8, 8, torch.float32)]
    per_row = naive_attention_kl(*inputs, reduction="none")
    expected = {"none": per_row, "sum": per_row.sum(), "mean": per_row.mean()}[reduction]
    loss_fn = AttentionKLLoss(reduction=reduction, backend=backend, block_q=8, block_k=8)
    got = loss_fn(*inputs)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (per_row >= -1e-6).all()   # a KL divergence


def test_bad_input_names_the_tensors():
    q, k = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    cases = [
        ((q, k, torch.randn(3, 8, 4, 16), k), "q_s must be"),           # batch mismatch
        ((q, k, torch.randn(2, 7, 4, 16), k), "q_s must be"),           # length mismatch
        ((q, k, q, torch.randn(2, 9, 2, 16)), "k_s must be"),           # key length mismatch
        ((q, torch.randn(2, 8, 3, 16), q, k), "k_t heads must divide"),  # GQA heads
        ((q, k, q, torch.randn(2, 8, 3, 16)), "k_s heads must divide"),
        ((q, torch.randn(2, 8, 2, 8), q, k), "k_t must be"),            # head dim mismatch
        ((q, k, q.bfloat16(), k.bfloat16()), "share one dtype"),
        ((q, k, q, k.long()), "k_s must be floating"),
        ((q[0], k, q, k), "q_t must be a 4-D"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            attention_kl(*args)
    with pytest.raises(ValueError, match="reduction"):
        attention_kl(q, k, q, k, reduction="avg")
    with pytest.raises(ValueError, match="backend"):
        attention_kl(q, k, q, k, backend="cuda")
    with pytest.raises(ValueError, match="block_q"):
        attention_kl(q, k, q, k, block_q=0)
    with pytest.raises(ValueError, match="B == 1"):
        attention_kl(q, k, q, k, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="scale_s"):
        attention_kl(q, k, q, k, scale_s=-1.0)


def test_bad_input_mixed_devices():
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="one device"):
        attention_kl(q, k, q.to("meta"), k.to("meta"))


def test_documented_signature():
    import inspect

    params = inspect.signature(attention_kl).parameters
    assert list(params)[:8] == ["q_t", "k_t", "q_s", "k_s", "scale_t", "scale_s", "causal",
                                "reduction"]
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
               for n in ("q_t", "k_t", "q_s", "k_s"))
    defaults = {"scale_t": None, "scale_s": None, "causal": True, "reduction": "mean"}
    for name, default in defaults.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[4:])
