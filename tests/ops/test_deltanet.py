"""Gated delta rule variants against the fp32 specification: outputs, final states and every
gradient (q, k, v, g, beta, initial state), both gate shapes, fp32 and bf16."""

import functools

import pytest
import torch
import torch.nn.functional as F

from hyla.ops.deltanet import (
    chunk_gated_delta,
    delta_decode_step,
    naive_recurrent_gated_delta,
    recurrent_gated_delta,
)
from hyla.ops.deltanet.chunk import unit_lower_inverse

LABELS = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def rel_rms(x, ref):
    ref = ref.float()
    return ((ref - x.float()).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 5e-3


def make_inputs(B, T, H, K, V, dtype, gate, per_channel, *, beta="mid", states=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    logits = torch.randn(*((B, T, H, K) if per_channel else (B, T, H)), generator=gen)
    # mild: logsigmoid(x)/16 (slow decay); harsh: logsigmoid(5x), down to about -20 a step
    g = F.logsigmoid(logits * 5) if gate == "harsh" else F.logsigmoid(logits) / 16
    b = torch.randn(B, T, H, generator=gen)
    # beta near 0 and 1: sigmoid(+-8 + noise), both in one tensor
    b = torch.sigmoid(b) if beta == "mid" else torch.sigmoid(torch.sign(b) * 8 + b / 4)
    h0 = torch.randn(states if states is not None else B, H, K, V, generator=gen)
    tensors = [x.to(dtype) for x in (q, k, v, g, b)] + [h0]
    return [x.requires_grad_() for x in tensors]


def run(fn, inputs, do, dht, **kw):
    q, k, v, g, beta, h0 = inputs
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
               use_qk_l2norm=True, **kw)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return [o.detach(), ht.detach()] + grads


def compare(name, got, ref, dtype):
    for label, x, r in zip(LABELS, got, ref, strict=True):
        assert torch.isfinite(x.float()).all(), f"{name}: {label} not finite"
        err = rel_rms(x, r)
        assert err < tol(dtype), f"{name}: {label} rel RMS {err:.2e} >= {tol(dtype):.0e}"


@functools.lru_cache(maxsize=64)
def case(shape, dtype, gate, per_channel, beta="mid", cu=None):
    """Inputs, cotangents and the spec's results on fp32 copies of the inputs (cached: the
    token loop is the slow part of these tests)."""
    B, T, H, K, V = shape
    N = len(cu) - 1 if cu is not None else B
    inputs = make_inputs(B, T, H, K, V, dtype, gate, per_channel, beta=beta, states=N)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)
    fp32 = [x.detach().float().requires_grad_() for x in inputs]
    kw = {"cu_seqlens": torch.tensor(cu)} if cu is not None else {}
    return inputs, do, dht, run(naive_recurrent_gated_delta, fp32, do, dht, **kw)


SHAPES = [(3, 1, 2, 16, 16), (2, 63, 2, 16, 32), (1, 130, 3, 32, 16), (1, 1000, 1, 16, 16)]
SHAPE_IDS = ["B3-T1-H2-K16-V16", "B2-T63-H2-K16-V32", "B1-T130-H3-K32-V16",
             "B1-T1000-H1-K16-V16"]
GATES = ["head", "channel"]


@pytest.mark.parametrize("gate", ["mild", "harsh"])
@pytest.mark.parametrize("per_channel", [False, True], ids=GATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_naive(chunk_size, shape, dtype, per_channel, gate):
    inputs, do, dht, ref = case(shape, dtype, gate, per_channel)
    got = run(chunk_gated_delta, inputs, do, dht, chunk_size=chunk_size)
    compare(f"chunk C={chunk_size}", got, ref, dtype)


@pytest.mark.parametrize("per_channel", [False, True], ids=GATES)
@pytest.mark.parametrize("chunk_size", [32, 128])
def test_chunk_sizes_and_extreme_beta(chunk_size, per_channel):
    # beta near 0 (almost no write) and near 1 (full overwrite), harsh gates
    inputs, do, dht, ref = case((2, 63, 2, 16, 32), torch.float32, "harsh", per_channel,
                                beta="extreme")
    compare("chunk", run(chunk_gated_delta, inputs, do, dht, chunk_size=chunk_size), ref,
            torch.float32)


@pytest.mark.parametrize("gate", ["mild", "harsh"])
@pytest.mark.parametrize("per_channel", [False, True], ids=GATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=SHAPE_IDS[:3])
def test_recurrent_matches_naive(shape, dtype, per_channel, gate):
    inputs, do, dht, ref = case(shape, dtype, gate, per_channel)
    compare("recurrent", run(recurrent_gated_delta, inputs, do, dht), ref, dtype)


# empty sequences (first, middle, last) and length-1 ones, packed into one row
CU = [(0, 0, 1, 40, 40, 41, 130, 130), (0, 63, 64, 64, 127)]


@pytest.mark.parametrize("per_channel", [False, True], ids=GATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cu", CU, ids=["with-empty-and-1", "63-1-0-63"])
def test_cu_seqlens(cu, dtype, per_channel):
    shape = (1, cu[-1], 2, 16, 16)
    inputs, do, dht, ref = case(shape, dtype, "harsh", per_channel, cu=cu)
    cu_t = torch.tensor(cu)
    for name, fn, kw in (("chunk", chunk_gated_delta, {"chunk_size": 16}),
                         ("recurrent", recurrent_gated_delta, {})):
        compare(name, run(fn, inputs, do, dht, cu_seqlens=cu_t, **kw), ref, dtype)


def test_cu_seqlens_equals_separate_sequences():
    gen = torch.Generator().manual_seed(3)
    q, k = F.normalize(torch.randn(2, 1, 50, 2, 8, generator=gen), dim=-1)
    v = torch.randn(1, 50, 2, 8, generator=gen)
    g = F.logsigmoid(torch.randn(1, 50, 2, generator=gen))
    beta = torch.rand(1, 50, 2, generator=gen)
    o, s = chunk_gated_delta(q, k, v, g, beta, output_final_state=True, chunk_size=16,
                             cu_seqlens=torch.tensor([0, 20, 50]))
    for n, (a, b) in enumerate([(0, 20), (20, 50)]):
        o_n, s_n = chunk_gated_delta(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b],
                                     beta[:, a:b], output_final_state=True, chunk_size=16)
        torch.testing.assert_close(o[:, a:b], o_n, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[n], s_n[0], atol=1e-5, rtol=1e-5)


def test_matches_flash_linear_attention_reference():
    fla = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    gen = torch.Generator().manual_seed(4)
    q, k = F.normalize(torch.randn(2, 2, 70, 3, 16, generator=gen), dim=-1)
    v = torch.randn(2, 70, 3, 8, generator=gen)
    g = F.logsigmoid(torch.randn(2, 70, 3, generator=gen))
    beta = torch.rand(2, 70, 3, generator=gen)
    h0 = torch.randn(2, 3, 16, 8, generator=gen)
    o_ref, s_ref = fla.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0,
                                                        output_final_state=True)
    o, s = chunk_gated_delta(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=GATES)
def test_gradcheck_float64(per_channel):
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = 1, 11, 1, 4, 3
    q, k = torch.randn(2, B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, *((K,) if per_channel else ()), generator=gen,
                                 dtype=torch.float64))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        o, s = chunk_gated_delta(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm=True, chunk_size=16)
        return o, s

    # per-channel scores come from GLA's intra_scores, which computes in float32
    if per_channel:
        o, s = fn(*args)
        o_ref, s_ref = naive_recurrent_gated_delta(*args[:5], initial_state=h0,
                                                   output_final_state=True, use_qk_l2norm=True)
        assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5
    else:
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


def test_unit_lower_inverse():
    A = torch.randn(2, 3, 64, 64, dtype=torch.float64).tril(-1) / 8
    eye = torch.eye(64, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(A), torch.linalg.inv(eye + A))


def test_recurrent_in_place_and_decode_step():
    gen = torch.Generator().manual_seed(6)
    q, k = F.normalize(torch.randn(2, 3, 1, 2, 8, generator=gen), dim=-1)
    v = torch.randn(3, 1, 2, 4, generator=gen)
    g = -torch.rand(3, 1, 2, 8, generator=gen)
    beta = torch.rand(3, 1, 2, generator=gen)
    state = torch.randn(3, 2, 8, 4, generator=gen)
    want_o, want_s = naive_recurrent_gated_delta(q, k, v, g, beta, initial_state=state,
                                                 output_final_state=True)
    s1 = state.clone()
    o, s = recurrent_gated_delta(q, k, v, g, beta, initial_state=s1, output_final_state=True)
    assert s.data_ptr() != s1.data_ptr() and torch.equal(s1, state)   # in place only if asked
    torch.testing.assert_close(s, want_s)
    o, s = recurrent_gated_delta(q, k, v, gk=g, beta=beta, initial_state=s1,
                                 output_final_state=True, inplace=True)
    assert s.data_ptr() == s1.data_ptr()
    torch.testing.assert_close(s1, want_s)
    torch.testing.assert_close(o, want_o)
    s2 = state.clone()
    torch.testing.assert_close(delta_decode_step(q, k, v, g, beta, s2), want_o)
    torch.testing.assert_close(s2, want_s)


def test_empty_and_fla_keywords():
    q = k = torch.randn(1, 0, 2, 4)
    v = torch.randn(1, 0, 2, 3)
    g, beta = torch.zeros(1, 0, 2), torch.zeros(1, 0, 2)
    h0 = torch.randn(1, 2, 4, 3)
    for fn in (chunk_gated_delta, recurrent_gated_delta, naive_recurrent_gated_delta):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        assert o.shape == (1, 0, 2, 3)
        torch.testing.assert_close(s, h0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        chunk_gated_delta(q, k, v, g, beta, head_first=True)


@pytest.mark.parametrize("fn", [chunk_gated_delta, recurrent_gated_delta,
                                naive_recurrent_gated_delta],
                         ids=["chunk", "recurrent", "naive"])
def test_bad_input_is_refused(fn):
    q = k = torch.randn(1, 5, 2, 4)
    v = torch.randn(1, 5, 2, 3)
    g, beta = -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    with pytest.raises(ValueError, match="g must be the log decay"):
        fn(q, k, v, g[..., :1], beta)
    with pytest.raises(ValueError, match="must be <= 0"):
        fn(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="beta must be"):
        fn(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="initial_state must be"):
        fn(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 4, 3))
    with pytest.raises(ValueError, match="v must be"):
        fn(q, k, v[:, :4], g, beta)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3]))
    if fn is chunk_gated_delta:
        with pytest.raises(ValueError, match="chunk_size"):
            fn(q, k, v, g, beta, chunk_size=48)
