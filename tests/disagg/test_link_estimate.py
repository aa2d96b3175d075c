"""The router's measured link (issue 30 items 1-2), torch-free and on a fake clock: the
estimate follows a slow link in a transfer or two, the cost model stops shipping when
shipping is slower than a local prefill and probes a small share, a recovered link is
used again, consecutive failures open the breaker and half-open probes close it, and the
deadline comes from the estimate and the state's size."""

import subprocess
import sys

import pytest

from hyla.disagg.live.router.links import LinkBook
from hyla.disagg.policy import PrfaasRouter, RouterConfig
from hyla.disagg.policy.link import LinkConfig, LinkEstimate, StateSize

MBIT4 = 0.004                      # Gbps
STATE = 100_000                    # bytes of one request's state
LOCAL_S = 0.07                     # a local prefill (queue + own), as forced-local measured


def _sample(link, gbps, now, rtt=0.01, nbytes=STATE, probe=False):
    wire = nbytes * 8 / (gbps * 1e9)
    link.observe(nbytes, seconds=wire + rtt, wire_s=wire, now=now, probe=probe)


def _route(r, link, now, nbytes=STATE):
    d = r.route(5000, now=now)
    assert d.target == "remote"            # the threshold alone would ship it
    return r.check_link(d, link, state_bytes=nbytes, local_prefill_s=LOCAL_S, now=now)


def test_no_torch_imported():
    code = ("import sys, hyla.disagg.policy.link, hyla.disagg.policy.prfaas; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_told_10_gbps_on_4_mbit_learns_it_in_two_transfers():
    link = LinkEstimate(LinkConfig(initial_gbps=10.0))
    assert link.transfer_s(STATE) < 1e-3                  # the prior believes 10 Gbps
    _sample(link, MBIT4, 0.0)
    _sample(link, MBIT4, 1.0)
    assert link.gbps < 0.01 and link.rtt_s == pytest.approx(0.01)
    assert link.transfer_s(STATE) == pytest.approx(0.01 + 0.2, rel=0.35)
    # a fast link is capped at the configured figure, however small the wire time
    fast = LinkEstimate(LinkConfig(initial_gbps=1.0))
    fast.observe(1000, seconds=0.001, wire_s=0.0, now=0.0)
    assert fast.gbps <= 1.0


def test_slow_link_stops_offloading_and_probes_a_small_share():
    r = PrfaasRouter(RouterConfig(threshold=1000, queue_margin_s=0.05))
    link = LinkEstimate(LinkConfig())
    assert _route(r, link, 0.0).target == "remote"       # nothing measured: the prior
    _sample(link, MBIT4, 0.5)
    _sample(link, MBIT4, 1.0)
    targets = []
    for i in range(200):
        d = _route(r, link, 2.0 + i * 0.01)
        targets.append(d.target)
        if d.reason == "probe":
            assert link.probes_in_flight == 1
            _sample(link, MBIT4, 2.0 + i * 0.01, probe=True)       # still slow
        else:
            assert d.target == "local" and d.reason == "link_slow"
    probes = targets.count("remote")
    assert 5 <= probes <= 15, probes                    # ~5% (probe_share)
    assert link.state == "degraded" and link.probes_in_flight == 0
    assert r.stats.routed["local"] == 200 - probes and r.stats.fallbacks == 200 - probes


def test_backlog_on_the_path_counts():
    r = PrfaasRouter(RouterConfig(threshold=1000, queue_margin_s=0.05))
    link = LinkEstimate(LinkConfig())
    _sample(link, 0.1, 0.0)                              # 100 Mbit/s: 8 ms a state
    d = r.route(5000)
    assert r.check_link(d, link, state_bytes=STATE, local_prefill_s=LOCAL_S).target == "remote"
    d = r.route(5000)
    assert r.check_link(d, link, state_bytes=STATE, local_prefill_s=LOCAL_S,
                        backlog_bytes=40 * STATE).reason == "link_slow"


def test_recovered_link_is_used_again_through_probes():
    r = PrfaasRouter(RouterConfig(threshold=1000, queue_margin_s=0.05))
    link = LinkEstimate(LinkConfig(probe_share=0.1))
    for t in range(3):
        _sample(link, MBIT4, float(t))
    now, shipped = 10.0, []
    for _ in range(100):                    # the link is back at 1 Gbps
        now += 0.05
        d = _route(r, link, now)
        if d.target == "remote":
            _sample(link, 1.0, now, probe=d.reason == "probe")
        shipped.append(d.reason == "long")
    assert link.state == "ok" and sum(shipped[-20:]) == 20
    assert shipped.index(True) < 60          # within a few probes of the recovery


def test_outage_opens_the_breaker_and_half_open_probes_close_it():
    cfg = LinkConfig(fail_threshold=3, probe_interval_s=1.0, probe_interval_max_s=4.0)
    r, link = PrfaasRouter(RouterConfig(threshold=1000, queue_margin_s=0.05)), LinkEstimate(cfg)
    _sample(link, 1.0, 0.0)
    for i in range(2):
        link.failure(STATE, 1.0, now=10.0 + i)
        assert link.state == "degraded"
    link.failure(STATE, 1.0, now=12.0)
    assert link.state == "down"
    assert _route(r, link, 12.5).reason == "link_down"
    d = _route(r, link, 13.0)                            # the backoff has passed
    assert d.reason == "probe" and link.probes_in_flight == 1
    assert _route(r, link, 13.1).reason == "link_down"   # one probe at a time
    link.failure(STATE, 1.0, now=14.0, probe=True)       # still down: back off (2 s)
    assert _route(r, link, 15.5).reason == "link_down"
    assert _route(r, link, 16.0).reason == "probe"
    _sample(link, 1.0, 16.2, probe=True)                 # back
    assert link.state == "ok" and _route(r, link, 16.3).reason == "long"
    v = link.view()
    assert v["state"] == "ok" and v["failures"] == 4 and v["probes"] == 2
    assert set(v) >= {"gbps_estimate", "rtt_s", "state", "last_transfer_s",
                      "probes_in_flight"}


def test_deadline_from_estimate_and_size():
    link = LinkEstimate(LinkConfig(min_deadline_s=1.0, max_deadline_s=30.0,
                                   deadline_factor=4.0))
    assert link.deadline_s(STATE) == 1.0                 # 10 Gbps: the floor
    _sample(link, MBIT4, 0.0)
    _sample(link, MBIT4, 1.0)
    d1, d10 = link.deadline_s(STATE), link.deadline_s(10 * STATE)
    assert 1.0 <= d1 < 2.0 and d10 > 5 * d1 / 2 and d10 <= 30.0
    assert link.deadline_s(10_000 * STATE) == 30.0


def test_state_size_and_book_verdicts_once():
    s = StateSize()
    for n in (100, 600, 1000):
        s.observe(n, 6000 + 57 * n)
    assert s.predict(2000) == pytest.approx(6000 + 57 * 2000, rel=1e-6)
    now = [0.0]
    book = LinkBook(LinkConfig(fail_threshold=2), clock=lambda: now[0])
    a = book.open("P", "D", tokens=100, probe=False)
    assert a.nbytes == 0                                 # nothing learnt yet
    a.acked({"bytes": 40_000, "transfer_s": 0.1, "wire_s": 0.08})
    b = book.open("P", "D", tokens=100, probe=False)
    assert b.nbytes == 40_000 and book.backlog[("P", "D")] == 40_000
    b.lost(2.0)
    b.acked({"bytes": 1, "transfer_s": 9})               # a late answer: ignored
    c = book.open("P", "D", tokens=100, probe=False)
    c.lost(2.0)
    link = book.links[("P", "D")]
    assert link.state == "down" and link.transfers == 1 and link.failures == 2
    assert book.backlog[("P", "D")] == 0 and book.degraded() == {"P -> D": "down"}
    metrics = "\n".join(book.metrics())
    assert 'hyla_router_link_state{prefill="P",decode="D",state="down"} 1' in metrics


def test_bad_config():
    with pytest.raises(ValueError, match="alpha"):
        LinkConfig(alpha=0)
    with pytest.raises(ValueError, match="initial_gbps"):
        LinkConfig(initial_gbps=0)
    with pytest.raises(ValueError, match="nbytes"):
        LinkEstimate().observe(-1, 1.0)
