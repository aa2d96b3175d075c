"""Sliding-window + sink softmax attention against the materialised masked reference."""

import pytest
import torch

from hyla.ops.attention import attention
from hyla.ops.window_attention import sink_window_attention, visible


def reference(q, k, v, pos, window, sinks, cu=None):
    T = q.shape[1]
    doc = torch.zeros(T, dtype=torch.long) if cu is None else torch.bucketize(
        torch.arange(T), cu[1:], right=True)
    mask = visible(pos, pos, window, sinks) & (doc[:, None] == doc[None])
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhts,bshd->bthd", s.masked_fill(~mask, -torch.inf).softmax(-1), v)


def rand(B, T, H, Hkv, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, D, generator=g, dtype=dtype),
            torch.randn(B, T, Hkv, D, generator=g, dtype=dtype),
            torch.randn(B, T, Hkv, D, generator=g, dtype=dtype))


@pytest.mark.parametrize("T,window,sinks", [(1, 4, 4), (10, 3, 1), (63, 5, 0), (100, 16, 4),
                                            (130, 64, 4), (1000, 64, 4)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_matches_masked_reference(T, window, sinks, H, Hkv):
    q, k, v = rand(2, T, H, Hkv, 8)
    pos = torch.arange(T)
    got = sink_window_attention(q, k, v, pos, window=window, sinks=sinks)
    torch.testing.assert_close(got, reference(q, k, v, pos, window, sinks), atol=1e-12,
                               rtol=1e-10)


def test_window_covering_everything_is_causal_attention():
    q, k, v = rand(1, 50, 4, 2, 8, torch.float32)
    got = sink_window_attention(q, k, v, torch.arange(50), window=64, sinks=0)
    torch.testing.assert_close(got, attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_packed_documents_see_only_themselves_and_their_own_sinks():
    q, k, v = rand(1, 90, 4, 2, 8)
    cu = torch.tensor([0, 7, 50, 90])
    pos = torch.arange(90) - torch.tensor([0, 7, 50]).repeat_interleave(torch.diff(cu))
    got = sink_window_attention(q, k, v, pos, window=9, sinks=3, cu_seqlens=cu)
    torch.testing.assert_close(got, reference(q, k, v, pos, 9, 3, cu), atol=1e-12, rtol=1e-10)
    for a, b in [(0, 7), (7, 50), (50, 90)]:
        alone = sink_window_attention(q[:, a:b], k[:, a:b], v[:, a:b], torch.arange(b - a),
                                      window=9, sinks=3)
        torch.testing.assert_close(got[:, a:b], alone, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("start", [1, 3, 10, 40])
def test_cache_continues_a_sequence(start):
    T, W, S = 60, 8, 3
    q, k, v = rand(1, T, 4, 2, 8, seed=1)
    full = reference(q, k, v, torch.arange(T), W, S)
    first = torch.arange(min(S, start))
    ring = torch.arange(max(S, start - W), max(S, start))  # the window, sinks excluded
    keep = torch.cat([first, ring])
    cache = (k[:, keep], v[:, keep], keep[None])
    got = sink_window_attention(q[:, start:], k[:, start:], v[:, start:], torch.arange(start, T),
                                window=W, sinks=S, cache=cache)
    torch.testing.assert_close(got, full[:, start:], atol=1e-12, rtol=1e-10)


def test_gradients_match_reference():
    q, k, v = (x.requires_grad_() for x in rand(1, 37, 4, 2, 8))
    pos = torch.arange(37)
    out = sink_window_attention(q, k, v, pos, window=6, sinks=2)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    want = torch.autograd.grad(reference(q, k, v, pos, 6, 2), (q, k, v), cot)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)
    assert torch.autograd.gradcheck(
        lambda a, b, c: sink_window_attention(a, b, c, pos[:9], window=3, sinks=1),
        tuple(x[:, :9].detach().requires_grad_() for x in (q, k, v)))


def test_bf16_close_to_fp32_reference():
    q, k, v = rand(1, 200, 4, 2, 32, torch.float32, seed=2)
    pos = torch.arange(200)
    ref = reference(q.double(), k.double(), v.double(), pos, 64, 4).float()
    got = sink_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos, window=64,
                                sinks=4).float()
    assert ((got - ref).norm() / ref.norm()) < 1e-2


def test_lse_is_the_rows_logsumexp():
    q, k, v = rand(1, 20, 2, 2, 4)
    _, lse = sink_window_attention(q, k, v, torch.arange(20), window=5, sinks=2,
                                   return_lse=True)
    s = torch.einsum("bthd,bshd->bhts", q, k) * 0.5
    pos = torch.arange(20)
    want = s.masked_fill(~visible(pos, pos, 5, 2), -torch.inf).logsumexp(-1)
    torch.testing.assert_close(lse, want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window"), (dict(window=4, sinks=-1), "sinks"),
    (dict(window=2.5), "window"), (dict(window=4, positions=torch.arange(3)), "positions")])
def test_bad_arguments_are_named(kwargs, match):
    q, k, v = rand(1, 5, 2, 2, 4)
    kwargs = {"positions": torch.arange(5), **kwargs}
    with pytest.raises(ValueError, match=match):
        sink_window_attention(q, k, v, **kwargs)


def test_bad_shapes_are_named():
    q, k, v = rand(1, 5, 3, 2, 4)
    with pytest.raises(ValueError, match="H_kv"):
        sink_window_attention(q, k, v, torch.arange(5), window=2)


def test_many_short_documents_across_blocks():
    lengths = [3, 2, 50, 1, 1, 7, 30, 2, 40]
    T = sum(lengths)
    q, k, v = rand(1, T, 4, 2, 8, seed=3)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in lengths])
    for window, sinks in [(16, 4), (5, 3), (64, 4)]:
        got = sink_window_attention(q, k, v, pos, window=window, sinks=sinks, cu_seqlens=cu)
        torch.testing.assert_close(got, reference(q, k, v, pos, window, sinks, cu),
                                   atol=1e-12, rtol=1e-10)
