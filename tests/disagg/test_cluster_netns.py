"""The PrfaaS cluster on a real network stack (issue 30): a prefill worker and a decode
worker + router in two Linux network namespaces, joined by a link that the kernel shapes
(``tc tbf``) and that this test's own forwarder cuts, delays (5 ms each way) and makes
lossy (this kernel has no ``netem`` and no iptables statistic match). The router is told
10 Gbps, as its README says. In order, under a bounded load (2 requests at a time):

1. a fast link: states are shipped, acknowledged and measured (``rtt_s`` sees the delay);
2. an outage: the path shows ``down`` within seconds, ``/health`` stays 200 but says
   ``degraded``, no request is lost and none waits anywhere near 30 s;
3. recovery: a half-open probe closes the breaker and states are shipped again;
4. 2% packet loss: everything completes;
5. a 4 Mbit/s link: the estimate falls to what the link carries and offloading stops
   (a few probes aside): the later requests are served locally;
6. the internal routes refuse unsigned calls across the namespaces.

Needs root, ``ip``, ``tc`` and ``/dev/net/tun``; skipped (saying why) otherwise. About a
minute on 2 cores, most of it starting the workers."""

import asyncio
import time

import httpx
import pytest

from hyla.disagg.live.netlab.cluster import LabCluster, drive, p90
from hyla.disagg.live.netlab.hosts import NetLab

TOKENS = 800            # a ~210 KB state: 0.4 s at 4 Mbit/s, far longer than a local prefill


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = NetLab.why_not()
    if why:
        pytest.skip(why)
    lab = NetLab().start()
    lab.set(delay_s=0.005)
    cl = LabCluster(lab, tmp_path_factory.mktemp("netns") / "roles.log")
    try:
        cl.start_workers()
        cl.start_router(link_gbps=10.0, threshold=64)
        cl.wait_ready()
        yield lab, cl
    except BaseException:
        print(cl.tail())
        raise
    finally:
        cl.stop()
        lab.close()


def _load(lab, cl, n, start, **kw):
    return lab.run_in("decode", lambda: asyncio.run(drive(cl.router_url, n, tokens=TOKENS,
                                                          start=start, **kw)))


def _path(cl) -> dict:
    (link,) = cl.get("/cluster")["links"].values()
    return link


def test_fast_link_ships_and_measures(lab):
    lab, cl = lab
    res = _load(lab, cl, 6, 0, concurrency=2)
    assert [r["status"] for r in res] == ["ok"] * 6, res
    view = cl.get("/cluster")
    assert view["counts"]["remote_ok"] >= 4, view["counts"]
    link = _path(cl)
    assert link["state"] == "ok" and link["transfers"] >= 4, link
    assert link["rtt_s"] >= 0.008, link                  # the 2 x 5 ms delay, at least


def test_outage_seen_within_seconds_and_nothing_lost(lab):
    lab, cl = lab
    seen: dict = {}
    cut_at, cut_for = 1.0, 8.0

    def run():
        async def tick(t):
            if "cut" not in seen and t >= cut_at:
                lab.set(down=True)
                seen["cut"] = t
            if "cut" in seen and "restored" not in seen and t >= cut_at + cut_for:
                lab.set(down=False)
                seen["restored"] = t
            if "cut" in seen and "down" not in seen:
                async with httpx.AsyncClient() as c:
                    v = (await c.get(cl.router_url + "/cluster", timeout=5)).json()
                    if any(x["state"] == "down" for x in v["links"].values()):
                        seen["down"] = t
                        h = await c.get(cl.router_url + "/health", timeout=5)
                        seen["health"] = (h.status_code, h.json())
        return asyncio.run(drive(cl.router_url, 20, tokens=TOKENS, start=100, concurrency=2,
                                 interval_s=0.4, on_tick=tick))
    try:
        res = lab.run_in("decode", run)
    finally:
        lab.set(down=False)
    assert [r["status"] for r in res] == ["ok"] * len(res), res      # nothing lost
    assert "down" in seen and seen["down"] - seen["cut"] <= 5.0, seen
    code, body = seen["health"]
    assert code == 200 and body["status"] == "degraded" and "down" in body["links"].values()
    slow = [r["e2e_s"] for r in res if r["e2e_s"] > 5.0]
    assert len(slow) <= 4, [round(r["e2e_s"], 2) for r in res]
    assert max(r["e2e_s"] for r in res) < 15.0           # no flat 30 s wait


def test_recovery_closes_the_breaker(lab):
    lab, cl = lab
    before = cl.get("/cluster")["counts"]["remote_ok"]
    deadline = time.monotonic() + 40
    i = 200
    while time.monotonic() < deadline:
        res = _load(lab, cl, 2, i, concurrency=2)
        i += 2
        assert all(r["status"] == "ok" for r in res), res
        if _path(cl)["state"] == "ok" and cl.get("/cluster")["counts"]["remote_ok"] > before:
            break
        time.sleep(0.5)
    link = _path(cl)
    assert link["state"] == "ok", link
    _load(lab, cl, 4, i, concurrency=2)
    assert cl.get("/cluster")["counts"]["remote_ok"] >= before + 2


def test_two_percent_loss_completes(lab):
    lab, cl = lab
    lab.set(loss=0.02)
    try:
        res = _load(lab, cl, 8, 300, concurrency=2)
    finally:
        lab.set(loss=0.0)
    assert [r["status"] for r in res] == ["ok"] * 8, res
    assert lab.stats["dropped"] > 0
    assert _path(cl)["state"] != "down"


def test_slow_link_stops_offloading(lab):
    lab, cl = lab
    lab.shape(4.0)                                       # 4 Mbit/s, told 10 Gbps
    try:
        before = cl.get("/cluster")
        res = _load(lab, cl, 24, 400, concurrency=2)
    finally:
        lab.shape(None)
    assert [r["status"] for r in res] == ["ok"] * 24, res
    view = cl.get("/cluster")
    link = _path(cl)
    assert link["gbps_estimate"] < 0.05, link            # it learnt the link
    slow = view["fallback_reasons"].get("link slower than local prefill", 0) - \
        before["fallback_reasons"].get("link slower than local prefill", 0)
    assert slow >= 12, view["fallback_reasons"]
    late = [r["e2e_s"] for r in res[12:]]
    assert p90(late) < 1.5, [round(x, 2) for x in late]


def test_unsigned_internal_calls_refused_across_the_link(lab):
    lab, cl = lab

    def probe():
        r1 = httpx.post(cl.prefill_url + "/internal/registry", timeout=10,
                        json={"decode": ["tcp://10.77.0.1:9999"]})
        r2 = httpx.get(cl.decode_url + "/internal/info", timeout=10)
        return r1.status_code, r2.status_code
    assert lab.run_in("decode", probe) == (401, 401)
