"""The live router's prefix-cache estimate and its cache-aware routing on incremental
length."""

import pytest

from hyla.disagg.live.router.core import LiveRouter, LiveRouterConfig, live_policy
from hyla.disagg.policy.prefix_index import PrefixIndex, chunk_chain


def test_chunk_chain_equal_prefixes_hash_equal():
    a = chunk_chain(list(range(100)), 16)
    b = chunk_chain(list(range(64)) + [7] * 36, 16)
    assert len(a) == 6                         # 100 // 16 whole chunks; the tail is not indexed
    assert a[:4] == b[:4] and a[4] != b[4]
    assert chunk_chain([1, 2, 3], 16) == []


def test_index_match_capacity_and_forget():
    idx = PrefixIndex(chunk_tokens=4, capacity=3)
    idx.insert("w", chunk_chain(list(range(12)), 4))
    assert idx.match("w", chunk_chain(list(range(20)), 4)) == 12
    assert idx.match("other", chunk_chain(list(range(20)), 4)) == 0
    idx.insert("w", chunk_chain([9] * 8, 4))     # 2 more chunks: the 2 oldest are dropped
    assert idx.match("w", chunk_chain(list(range(12)), 4)) == 0
    assert idx.match("w", chunk_chain([9] * 8, 4)) == 8
    idx.forget("w")
    assert idx.best(chunk_chain([9] * 8, 4)) == (None, 0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixIndex(chunk_tokens=0)


def _router(**kw):
    cfg = LiveRouterConfig(prefill_urls=["http://p"], decode_urls=["http://d1", "http://d2"],
                           model_name="m", policy=live_policy(threshold=300, adapt=False),
                           prefix_chunk_tokens=256, **kw)
    r = LiveRouter(cfg, None)
    for w in r.prefill + r.decode:
        w.healthy = True
    return r


def test_router_routes_on_incremental_length():
    r = _router()
    prompt = [(i * 7) % 250 + 1 for i in range(600)]
    target, chain, on = r.plan(prompt)
    assert (target, on) == ("remote", None)      # 600 new tokens > t = 300
    r.prefix.insert("http://d2", chain)          # d2 prefilled it locally before
    follow_up = prompt + [5] * 80                # the next turn: 680 tokens, 512 cached
    target, _, on = r.plan(follow_up)
    assert (target, on) == ("local", "http://d2")
    assert r.counts["cached_local"] == 1 and r.counts["cached_tokens"] == 512
    assert r._pick(r.decode, prefer=on).url == "http://d2"
    r.decode[1].healthy = False                  # its cache is out of reach: long again
    assert r.plan(follow_up)[0] == "remote"


def test_forced_path_ignores_the_cache():
    r = _router(force="remote")
    prompt = list(range(1, 600))
    r.prefix.insert("http://d1", chunk_chain(prompt, 256))
    assert r.plan(prompt)[0] == "remote"
