"""The PrfaaS routing policy: threshold, cache-aware placement, fallback, control of t."""

import sys

import pytest

from hyla.disagg.policy.prfaas import LOCAL, REMOTE, PrfaasRouter, RouterConfig, recommend_pd_split


def router(**kw):
    return PrfaasRouter(RouterConfig(**{"threshold": 10_000, **kw}))


def test_no_torch_imported():
    import subprocess

    code = ("import sys, hyla.disagg.policy.prfaas; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("prompt,cached,target,compute", [
    (500, {}, LOCAL, 500),                                   # short
    (10_000, {}, LOCAL, 10_000),                             # exactly t stays local
    (10_001, {}, REMOTE, 10_001),                            # long
    (30_000, {LOCAL: 25_000}, LOCAL, 5_000),                 # long but cached locally
    (30_000, {REMOTE: 8_000}, REMOTE, 22_000),               # remote cache counts there
], ids=["short", "at-threshold", "long", "cached-local", "cached-remote"])
def test_route_threshold_on_incremental_length(prompt, cached, target, compute):
    d = router().route(prompt, cached)
    assert (d.target, d.compute_tokens) == (target, compute)
    assert d.compute_tokens + d.cached_tokens == prompt


def test_best_global_cache_when_link_idle_cache_affine_when_busy():
    r = router()
    r.observe(0.0, link_util=0.1)                # abundant: the remote prefix can move here
    d = r.route(30_000, {LOCAL: 0, REMOTE: 25_000})
    assert d.target == LOCAL and d.compute_tokens == 5_000
    assert d.cache_transfer == (REMOTE, LOCAL, 25_000)
    r.observe(1.0, link_util=0.6)                # not abundant: each cluster its own cache
    d = r.route(30_000, {LOCAL: 0, REMOTE: 25_000})
    assert d.target == REMOTE and d.compute_tokens == 5_000 and d.cache_transfer is None


def test_fallback_when_remote_down_or_saturated():
    r = router(max_remote_queue_s=10.0)
    r.observe(0.0, remote_up=False)
    assert r.route(50_000).target == LOCAL and r.route(50_000).reason == "fallback"
    r.observe(1.0, remote_up=True, remote_queue_s=11.0, local_queue_s=20.0)
    assert r.route(50_000).target == LOCAL
    r.observe(2.0, remote_queue_s=1.0, local_queue_s=1.0)
    assert r.route(50_000).target == REMOTE
    assert r.stats.fallbacks == 3


def test_threshold_moves_with_link_and_queues_and_stays_clamped():
    r = router(t_min=5_000, t_max=20_000)
    t0 = r.t
    assert r.observe(0, egress_gbps=90.0) > t0            # busy link: offload less
    r = router(t_min=5_000, t_max=20_000)
    assert r.observe(0, remote_queue_s=30.0, local_queue_s=1.0) > t0   # remote backed up
    r = router(t_min=5_000, t_max=20_000)
    assert r.observe(0, egress_gbps=5.0, local_queue_s=30.0) < t0      # local backed up
    for i in range(100):
        r.observe(i, egress_gbps=5.0, local_queue_s=30.0)
    assert r.t == 5_000
    for i in range(100):
        r.observe(i, egress_gbps=99.0)
    assert r.t == 20_000
    frozen = router(adapt=False)
    assert frozen.observe(0, egress_gbps=99.0) == 10_000


def test_bad_input():
    with pytest.raises(ValueError, match="prompt_len"):
        router().route(0)
    with pytest.raises(ValueError, match="t_min"):
        RouterConfig(threshold=10, t_min=100)
    with pytest.raises(ValueError, match="step"):
        RouterConfig(step=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        router().observe(0, link_util=-1)


def test_recommend_pd_split():
    assert recommend_pd_split(8, 2, prefill_busy=0.9, decode_busy=0.3) == 4
    assert recommend_pd_split(8, 4, prefill_busy=0.0, decode_busy=1.0) == 1
    assert recommend_pd_split(8, 4, prefill_busy=1.0, decode_busy=0.0) == 7
    assert recommend_pd_split(8, 3, 0.0, 0.0) == 3
    with pytest.raises(ValueError):
        recommend_pd_split(1, 1, 0.5, 0.5)
