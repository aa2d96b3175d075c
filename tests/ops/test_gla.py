"""GLA variants against the fp32 specification: outputs, final states and every gradient."""

import pytest
import torch
import torch.nn.functional as F

from hyla.ops.gla import chunk_gla, naive_recurrent_gla, recurrent_gla


def rel_rms(x, ref):
    ref = ref.float()
    return ((ref - x.float()).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 5e-3


def make_inputs(B, T, H, K, V, dtype, gate, *, states=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    logits = torch.randn(B, T, H, K, generator=gen)
    # mild: logsigmoid(x)/16 (slow forgetting); medium: logsigmoid(x)/2, a chunk's gates
    # spanning tens (overflows fp16 if factored naively); harsh: logsigmoid(5x), to ~-20 a step
    g = F.logsigmoid(logits * {"mild": 1, "medium": 1, "harsh": 5}[gate])
    g = g / {"mild": 16, "medium": 2, "harsh": 1}[gate]
    h0 = torch.randn(states if states is not None else B, H, K, V, generator=gen)
    tensors = [x.to(dtype) for x in (q, k, v, g)] + [h0]
    return [x.requires_grad_() for x in tensors]


def run(fn, inputs, do, dht, **kw):
    q, k, v, g, h0 = inputs
    o, ht = fn(q, k, v, g, initial_state=h0, output_final_state=True, **kw)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return [o, ht] + grads


def compare(name, got, ref, dtype):
    labels = ["o", "ht", "dq", "dk", "dv", "dg", "dh0"]
    for label, x, r in zip(labels, got, ref, strict=True):
        assert torch.isfinite(x.float()).all(), f"{name}: {label} not finite"
        err = rel_rms(x, r)
        assert err < tol(dtype), f"{name}: {label} rel RMS {err:.2e} >= {tol(dtype):.0e}"


def reference(inputs, do, dht, **kw):
    """The spec on fp32 copies of the (possibly low-precision) inputs."""
    fp32 = [x.detach().float().requires_grad_() for x in inputs]
    return run(naive_recurrent_gla, fp32, do, dht, **kw)


SHAPES = [(2, 63, 2, 16, 32), (1, 130, 3, 32, 16), (1, 1000, 1, 16, 16)]
SHAPE_IDS = ["B2-T63-H2-K16-V32", "B1-T130-H3-K32-V16", "B1-T1000-H1-K16-V16"]


@pytest.mark.parametrize("gate", ["mild", "harsh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("chunk_size", [64, 128])
def test_chunk_matches_naive(shape, dtype, gate, chunk_size):
    B, T, H, K, V = shape
    inputs = make_inputs(B, T, H, K, V, dtype, gate)
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    ref = reference(inputs, do, dht)
    compare("chunk", run(chunk_gla, inputs, do, dht, chunk_size=chunk_size), ref, dtype)


@pytest.mark.parametrize("gate", ["mild", "harsh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recurrent_matches_naive(dtype, gate):
    B, T, H, K, V = 2, 37, 2, 16, 8
    inputs = make_inputs(B, T, H, K, V, dtype, gate)
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    compare("recurrent", run(recurrent_gla, inputs, do, dht), reference(inputs, do, dht), dtype)


def test_chained_naive_recurrent_chunk():
    """naive -> recurrent -> chunk: each agrees with the previous one."""
    B, T, H, K, V = 1, 100, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, torch.float32, "mild")
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    naive = run(naive_recurrent_gla, inputs, do, dht)
    rec = run(recurrent_gla, inputs, do, dht)
    compare("recurrent", rec, naive, torch.float32)
    compare("chunk", run(chunk_gla, inputs, do, dht, chunk_size=16), rec, torch.float32)


@pytest.mark.parametrize("fn", [chunk_gla, recurrent_gla], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_matches_naive(fn, dtype):
    cu = torch.tensor([0, 1, 64, 64, 130, 307])  # lengths 1, 63, 0, 66, 177
    N = len(cu) - 1
    inputs = make_inputs(1, 307, 2, 16, 32, dtype, "harsh", states=N)
    do, dht = torch.randn(1, 307, 2, 32), torch.randn(N, 2, 16, 32)
    ref = reference(inputs, do, dht, cu_seqlens=cu)
    kw = {"cu_seqlens": cu} | ({"chunk_size": 64} if fn is chunk_gla else {})
    compare(fn.__name__, run(fn, inputs, do, dht, **kw), ref, dtype)


def test_varlen_equals_separate_sequences():
    q, k, v, g, _ = (x.detach() for x in make_inputs(1, 90, 2, 8, 8, torch.float32, "mild"))
    cu = torch.tensor([0, 40, 90])
    o, ht = chunk_gla(q, k, v, g, cu_seqlens=cu, output_final_state=True, chunk_size=16)
    for n, (s, e) in enumerate([(0, 40), (40, 90)]):
        o_n, h_n = chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], output_final_state=True,
                             chunk_size=16)
        torch.testing.assert_close(o[:, s:e], o_n, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[n], h_n[0], rtol=1e-5, atol=1e-5)


def test_extreme_gates_stay_finite():
    """Log-gates of -100 per step would overflow any exp(G_i) * exp(-G_j) factorisation."""
    q, k, v, _, _ = (x.detach() for x in make_inputs(1, 128, 1, 16, 16, torch.float32, "mild"))
    g = torch.full_like(q, -100.0)
    o, ht = chunk_gla(q, k, v, g, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, g, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(ht, ht_ref) < 1e-5


def test_recurrent_advances_state_in_place():
    """In place only when asked (inplace=True, as the serving runner does); by default the
    caller's initial_state is left as it was, as flash-linear-attention leaves it."""
    q, k, v, g, h0 = (x.detach() for x in make_inputs(3, 1, 2, 8, 8, torch.float32, "mild"))
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state = h0.clone()
    o, ht = recurrent_gla(q, k, v, g, initial_state=state, output_final_state=True)
    assert ht.data_ptr() != state.data_ptr() and torch.equal(state, h0)
    torch.testing.assert_close(ht, ht_ref)
    o, ht = recurrent_gla(q, k, v, g, initial_state=state, output_final_state=True, inplace=True)
    assert ht.data_ptr() == state.data_ptr()
    torch.testing.assert_close(state, ht_ref)
    torch.testing.assert_close(o, o_ref)


@pytest.mark.parametrize("fn", [chunk_gla, naive_recurrent_gla, recurrent_gla],
                         ids=["chunk", "naive", "recurrent"])
def test_fla_keyword_and_inplace_contract(fn):
    """gk= (fla's name) gives what g= gives; inplace=True writes the final state into
    initial_state (any state dtype); it refuses a missing state and a gradient."""
    q, k, v, g, h0 = (x.detach() for x in make_inputs(2, 37, 2, 8, 8, torch.float32, "mild"))
    o_g, ht_g = fn(q, k, v, g, initial_state=h0, output_final_state=True)
    o_k, ht_k = fn(q, k, v, gk=g, initial_state=h0, output_final_state=True)
    assert torch.equal(o_g, o_k) and torch.equal(ht_g, ht_k)
    for dtype in (torch.float32, torch.float64):
        state = h0.clone().to(dtype)
        o, ht = fn(q, k, v, gk=g, initial_state=state, inplace=True)
        assert ht is None
        torch.testing.assert_close(o, o_g)
        torch.testing.assert_close(state, ht_g.to(dtype))
    with pytest.raises(ValueError, match="not both"):
        fn(q, k, v, g, gk=g)
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, g, inplace=True)
    with pytest.raises(ValueError, match="requires grad"):
        fn(q.requires_grad_(), k, v, g, initial_state=h0.clone(), inplace=True)


@pytest.mark.parametrize("fn", [chunk_gla, naive_recurrent_gla, recurrent_gla],
                         ids=["chunk", "naive", "recurrent"])
def test_bad_input_names_the_argument(fn):
    q = torch.randn(2, 8, 2, 4)
    v = torch.randn(2, 8, 2, 3)
    g = -torch.rand(2, 8, 2, 4)
    with pytest.raises(ValueError, match="k must"):
        fn(q, torch.randn(2, 8, 3, 4), v, g)
    with pytest.raises(ValueError, match="v must"):
        fn(q, q, torch.randn(2, 7, 2, 3), g)
    with pytest.raises(ValueError, match="g is a log forget gate"):
        fn(q, q, v, -g)
    with pytest.raises(ValueError, match="q must be a 4-D"):
        fn(q[0], q, v, g)
    with pytest.raises(ValueError, match="B == 1"):
        fn(q, q, v, g, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="end at T=8"):
        fn(q[:1], q[:1], v[:1], g[:1], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, q, v, g, initial_state=torch.zeros(2, 2, 4, 4))


def test_bad_chunk_size():
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gla(q, q, q, -q.abs(), chunk_size=48)


@pytest.mark.parametrize("gate", ["mild", "medium", "harsh"])
@pytest.mark.parametrize("chunk_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_low_precision_matmuls_match_naive(monkeypatch, gate, chunk_size, dtype):
    """Where the hardware has bf16/fp16 GEMMs (GPU, AMX), chunk_gla multiplies in that dtype:
    check that path here too, whatever this machine would choose."""
    from hyla.ops.gla import chunk as chunk_module

    monkeypatch.setattr(chunk_module, "matmul_dtype", lambda x: x.dtype)
    B, T, H, K, V = 2, 130, 2, 32, 32
    inputs = make_inputs(B, T, H, K, V, dtype, gate)
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    ref = reference(inputs, do, dht)
    got = run(chunk_gla, inputs, do, dht, chunk_size=chunk_size)
    compare(f"chunk-{dtype}-matmuls", got, ref, dtype)
