"""Backend dispatch of the linear-attention ops, on a CPU.

The selection rule runs against backends the tests register. fla's Triton kernels do not run
on a CPU (nor under TRITON_INTERPRET=1: its autotuned kernels fail there), so the fla
adapter (:mod:`hyla.ops.fla_backend`) is run on fla's own pure-PyTorch references, wrapped
in fakes that enforce fla's conventions (B = 1 with int64 cu_seqlens, float32
initial_state, which they must not see modified) and record every call.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hyla.ops import backends
from hyla.ops.backends import Backend, register_backend, select, unregister_backend
from hyla.ops.deltanet import (
    chunk_gated_delta,
    naive_recurrent_gated_delta,
    recurrent_gated_delta,
)
from hyla.ops.fla_backend import make_fla_backend
from hyla.ops.gla import chunk_gla, naive_recurrent_gla, recurrent_gla


def _gla_inputs(B=2, T=37, H=2, K=8, V=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, h0


def _delta_inputs(B=2, T=29, H=2, K=8, V=4, per_channel=False, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, *((K,) if per_channel else ()), generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


@pytest.fixture
def registry():
    """Backends registered by a test are removed afterwards."""
    names = []

    def add(backend):
        register_backend(backend)
        names.append(backend.name)
        return backend

    yield add
    for n in names:
        unregister_backend(n)


def _recording(name, priority, log, accept=True):
    def wrap(op):
        def run(*args, **kwargs):
            log.append((name, op, kwargs))
            return backends.NATIVE.ops[op](*args, **kwargs)
        return run

    return Backend(name, {op: wrap(op) for op in backends.OPS},
                   supports=lambda op, a, kw: None if accept else "declined",
                   priority=priority)


# ------------------------------------------------------------------------- selection

def test_cpu_default_is_native_and_bit_identical(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    q, k, v, g, h0 = _gla_inputs()
    assert select("chunk_gla", (q, k, v, g), {}) == "native"
    assert select("recurrent_gla", (q, k, v, g), {}) == "native"
    assert "fla" in backends.backends()          # registered, declines CPU tensors
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    o_n, ht_n = chunk_gla.native(q, k, v, g, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_n) and torch.equal(ht, ht_n)
    d = _delta_inputs()
    o, ht = chunk_gated_delta(*d[:5], initial_state=d[5], output_final_state=True)
    o_n, ht_n = chunk_gated_delta.native(*d[:5], initial_state=d[5], output_final_state=True)
    assert torch.equal(o, o_n) and torch.equal(ht, ht_n)


def test_auto_picks_highest_priority_that_supports(registry, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    log = []
    registry(_recording("low", 5, log))
    registry(_recording("high", 50, log))
    registry(_recording("declines", 99, log, accept=False))
    q, k, v, g, _ = _gla_inputs()
    o, _ = chunk_gla(q, k, v, gk=g, chunk_size=16)
    assert [(n, op) for n, op, _ in log] == [("high", "chunk_gla")]
    assert log[0][2]["gk"] is g and log[0][2]["chunk_size"] == 16   # arguments pass through
    assert torch.equal(o, chunk_gla.native(q, k, v, g, chunk_size=16)[0])
    d = _delta_inputs()
    recurrent_gated_delta(*d[:5])
    assert log[-1][:2] == ("high", "recurrent_gated_delta")


def test_backend_argument_and_environment_force(registry, monkeypatch):
    log = []
    registry(_recording("fake", 50, log))
    q, k, v, g, _ = _gla_inputs()
    monkeypatch.setenv(backends.ENV_VAR, "native")
    chunk_gla(q, k, v, g)
    assert log == []
    chunk_gla(q, k, v, g, backend="fake")                     # the argument beats the env
    assert [n for n, *_ in log] == ["fake"]
    monkeypatch.setenv(backends.ENV_VAR, "fake")
    recurrent_gla(q, k, v, g)
    assert [n for n, *_ in log] == ["fake", "fake"]
    chunk_gla(q, k, v, g, backend="native")
    assert len(log) == 2
    monkeypatch.setenv(backends.ENV_VAR, "auto")
    chunk_gla(q, k, v, g)
    assert len(log) == 3


def test_forced_backend_that_cannot_run_is_an_error(registry, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    registry(_recording("picky", 50, [], accept=False))
    q, k, v, g, _ = _gla_inputs()
    with pytest.raises(ValueError, match="'picky' cannot run this chunk_gla call: declined"):
        chunk_gla(q, k, v, g, backend="picky")
    with pytest.raises(ValueError, match="need CUDA"):
        chunk_gla(q, k, v, g, backend="fla")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        chunk_gla(q, k, v, g, backend="nope")
    monkeypatch.setenv(backends.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="HYLA_OPS_BACKEND must be"):
        chunk_gla(q, k, v, g)
    with pytest.raises(ValueError, match="cannot be removed"):
        unregister_backend("native")


def test_mixers_go_through_the_dispatch(registry, monkeypatch):
    """The model's training and prefill forwards reach the registered backend (G and D)."""
    from dataclasses import replace

    from hyla.model import HylaLM, preset
    from hyla.model.context import Context

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    log = []
    registry(_recording("fake", 50, log))
    torch.manual_seed(0)
    model = HylaLM(replace(preset("debug"), layers="GDA")).eval()
    ids = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        model(ids, Context.train(ids))
    assert {op for _, op, _ in log} == {"chunk_gla", "chunk_gated_delta"}


# ------------------------------------------------------------- the fla adapter, on CPU

def _fla_reference_kernels(calls):
    """fla's kernel entry points, computed by fla's PyTorch references, checking fla's
    conventions the way its kernels do (and recording the calls)."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla as fla_naive_gla
    from fla.ops.kda.naive import naive_recurrent_kda

    def varlen(name, step, q, k, v, initial_state, output_final_state, cu_seqlens, scale,
               **rest):
        calls.append((name, dict(rest, scale=scale, cu_seqlens=cu_seqlens,
                                 output_final_state=output_final_state)))
        if cu_seqlens is not None:
            assert q.shape[0] == 1, "fla: B must be 1 with cu_seqlens"
            assert cu_seqlens.dtype == torch.long
        if initial_state is not None:
            assert initial_state.dtype == torch.float32, "fla: initial_state must be float32"
            before = initial_state.clone()
        spans = ([(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu_seqlens is None else
                 [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(),
                                            strict=True)])
        outs, finals = [], []
        for n, (b, s, e) in enumerate(spans):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, ht = step(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], (b, s, e), h0, scale)
            outs.append(o)
            finals.append(ht)
        o = torch.cat(outs, 1) if cu_seqlens is not None else torch.cat(outs, 0)
        if initial_state is not None:
            assert torch.equal(initial_state, before), "the adapter must not expect in place"
        return o.to(v.dtype), (torch.cat(finals) if output_final_state else None)

    def gla(name):
        def run(q, k, v, g=None, *, gk=None, scale, initial_state, output_final_state,
                cu_seqlens):
            gate = g if g is not None else gk

            def step(q, k, v, span, h0, scale):
                b, s, e = span
                # fla's reference has no scale argument: it always uses K ** -0.5
                qs = q * (scale * q.shape[-1] ** 0.5)
                return fla_naive_gla(qs, k, v, gate[b:b + 1, s:e], h0, True)
            return varlen(name, step, q, k, v, initial_state, output_final_state, cu_seqlens,
                          scale)
        return run

    def delta(name, per_channel_kw):
        def run(q, k, v, g=None, beta=None, *, gk=None, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
            decay = g if g is not None else gk
            assert (decay.dim() == 4) == per_channel_kw, f"{name}: wrong gate shape"
            if use_qk_l2norm_in_kernel:
                q, k = F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1,
                                                                              eps=1e-6)

            def step(q, k, v, span, h0, scale):
                b, s, e = span
                gs, bs = decay[b:b + 1, s:e], beta[b:b + 1, s:e]
                if decay.dim() == 4:
                    return naive_recurrent_kda(q, k, v, gs, bs, scale, h0, True)
                return naive_recurrent_gated_delta_rule(q, k, v, bs, gs, scale, h0, True)
            return varlen(name, step, q, k, v, initial_state, output_final_state, cu_seqlens,
                          scale, l2=use_qk_l2norm_in_kernel)
        return run

    def fused_recurrent_delta(q, k, v, g=None, gk=None, beta=None, **kw):
        kind = gk is not None
        return delta("fused_recurrent_gated_delta_rule", kind)(q, k, v, g, beta, gk=gk, **kw)

    return SimpleNamespace(chunk_gla=gla("chunk_gla"),
                           fused_recurrent_gla=gla("fused_recurrent_gla"),
                           chunk_gated_delta_rule=delta("chunk_gated_delta_rule", False),
                           chunk_kda=delta("chunk_kda", True),
                           fused_recurrent_gated_delta_rule=fused_recurrent_delta)


@pytest.fixture
def fla_on_cpu(registry, monkeypatch):
    pytest.importorskip("fla")
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    calls = []
    kernels = _fla_reference_kernels(calls)
    registry(make_fla_backend(lambda: kernels, name="fla-ref", require_cuda=False))
    return calls


@pytest.mark.parametrize("op", [chunk_gla, recurrent_gla], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
def test_fla_adapter_gla_matches_native(fla_on_cpu, op, packed):
    q, k, v, g, h0 = _gla_inputs()
    cu = None
    if packed:                                       # two sequences of 15 and 59 tokens
        q, k, v, g = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g))
        cu = torch.tensor([0, 15, 74], dtype=torch.int32)
    want_o, want_h = naive_recurrent_gla(q, k, v, g, scale=0.3, initial_state=h0,
                                         output_final_state=True, cu_seqlens=cu)
    o, ht = op(q, k, v, gk=g, scale=0.3, initial_state=h0.to(torch.float64),
               output_final_state=True, cu_seqlens=cu, backend="fla-ref")
    name, kw = fla_on_cpu[-1]
    assert name == ("chunk_gla" if op is chunk_gla else "fused_recurrent_gla")
    assert kw["scale"] == 0.3 and (cu is None) == (kw["cu_seqlens"] is None)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("op", [chunk_gated_delta, recurrent_gated_delta],
                         ids=["chunk", "recurrent"])
def test_fla_adapter_gated_delta_matches_native(fla_on_cpu, op, per_channel):
    q, k, v, g, beta, h0 = _delta_inputs(per_channel=per_channel)
    want_o, want_h = naive_recurrent_gated_delta(q, k, v, g, beta, initial_state=h0,
                                                 output_final_state=True, use_qk_l2norm=True)
    o, ht = op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True, backend="fla-ref")
    name, kw = fla_on_cpu[-1]
    expected = {(chunk_gated_delta, False): "chunk_gated_delta_rule",
                (chunk_gated_delta, True): "chunk_kda"}.get((op, per_channel),
                                                            "fused_recurrent_gated_delta_rule")
    assert name == expected and kw["l2"] is True
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, want_h, rtol=1e-5, atol=1e-5)


def test_fla_adapter_inplace_and_errors(fla_on_cpu):
    q, k, v, g, h0 = _gla_inputs(dtype=torch.bfloat16)
    _, want_h = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state = h0.clone()
    o, ht = recurrent_gla(q, k, v, g, initial_state=state, backend="fla-ref")
    assert ht is None and torch.equal(state, h0)                 # untouched unless asked
    assert fla_on_cpu[-1][1]["output_final_state"] is False
    assert o.dtype == torch.bfloat16
    o, ht = recurrent_gla(q, k, v, g, initial_state=state, inplace=True, backend="fla-ref")
    assert ht is None
    torch.testing.assert_close(state, want_h, rtol=1e-5, atol=1e-5)
    # hyla's own checks run first, with hyla's messages
    with pytest.raises(ValueError, match="log forget gate and must be <= 0"):
        chunk_gla(q, k, v, -g, backend="fla-ref")
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gla(q, k, v, g, inplace=True, backend="fla-ref")
    with pytest.raises(ValueError, match="cu_seqlens|B"):
        chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 10, 37]), backend="fla-ref")
