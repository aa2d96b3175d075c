"""Softmax attention ops against a materialised reference (explicit mask, repeated k/v heads)."""

import pytest
import torch

from hyla.ops.attention import attention, attention_with_cache


def reference(q, k, v, mask, scale=None):
    """q [B,T,H,D], k/v [B,S,Hkv,D], mask [B,T,S] bool (True = attend)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v.double()).to(q.dtype)


def causal_mask(B, T):
    return torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)


@pytest.mark.parametrize("B,T,H,Hkv,D", [(2, 37, 4, 4, 16), (1, 63, 4, 2, 8), (3, 1, 6, 1, 32)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_matches_reference(B, T, H, Hkv, D, causal):
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D)
    k, v = torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    mask = causal_mask(B, T) if causal else torch.ones(B, T, T, dtype=torch.bool)
    o = attention(q, k, v, causal=causal)
    assert o.shape == (B, T, H, D)
    torch.testing.assert_close(o, reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    o = attention(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(o, reference(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)


def test_cu_seqlens_block_diagonal():
    torch.manual_seed(0)
    offsets = [0, 5, 5, 22, 37]            # includes an empty document
    T = offsets[-1]
    q, k, v = torch.randn(1, T, 4, 8), torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8)
    doc = torch.bucketize(torch.arange(T), torch.tensor(offsets[1:]), right=True)
    mask = (doc[:, None] == doc[None, :]) & causal_mask(1, T)[0]
    o = attention(q, k, v, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
    torch.testing.assert_close(o, reference(q, k, v, mask[None]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 5], ids=["decode", "chunk"])
def test_with_cache_matches_reference(T):
    torch.manual_seed(0)
    lens = torch.tensor([T, 9, 17])        # valid keys per sequence, new tokens included
    B, S = 3, 20
    q = torch.randn(B, T, 4, 8)
    k, v = torch.randn(B, S, 2, 8), torch.randn(B, S, 2, 8)
    pos = lens[:, None] - T + torch.arange(T)
    mask = torch.arange(S)[None, None] <= pos[..., None]
    o = attention_with_cache(q, k, v, lens)
    torch.testing.assert_close(o, reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    # Padding really is ignored: garbage past each length changes nothing.
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2[b, n:], v2[b, n:] = 1e4, -1e4   # finite: 0 * nan would leak
    torch.testing.assert_close(attention_with_cache(q, k2, v2, lens), o)


def test_with_cache_equals_causal_when_cache_is_the_sequence():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 37, 4, 8), torch.randn(1, 37, 2, 8), torch.randn(1, 37, 2, 8)
    full = attention(q, k, v)
    torch.testing.assert_close(attention_with_cache(q[:, 30:], k, v, [37]), full[:, 30:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call,match", [
    (lambda: attention(torch.randn(2, 3, 4), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
     "q must be a 4-D"),
    (lambda: attention(torch.randn(1, 3, 4, 8), torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8)),
     "divide the query heads"),
    (lambda: attention(torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)),
     "k must be"),
    (lambda: attention(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8),
                       cu_seqlens=torch.tensor([0, 3])), "B == 1"),
    (lambda: attention(torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8),
                       cu_seqlens=torch.tensor([0, 2])), "end at T=3"),
    (lambda: attention(torch.randn(1, 3, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)),
     "S == T"),
    (lambda: attention_with_cache(torch.randn(2, 2, 4, 8), torch.randn(2, 5, 2, 8),
                                  torch.randn(2, 5, 2, 8), torch.tensor([1, 5])), "kv_lens"),
    (lambda: attention_with_cache(torch.randn(2, 1, 4, 8), torch.randn(2, 5, 2, 8),
                                  torch.randn(2, 5, 2, 8), torch.tensor([3])), "kv_lens"),
], ids=["q-dims", "gqa-heads", "k-dim", "cu-batch", "cu-end", "causal-len", "lens-short",
        "lens-shape"])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
