"""PrfaaS over a real, shaped link keeps latency bounded and survives an outage and loss.

Root only: two network namespaces (prefill worker | decode worker + router), the prefill ->
decode link shaped by ``tc tbf``, cut, delayed 5 ms or made lossy by
:mod:`hyla.disagg.live.netlab`; debug preset, one torch thread a process. A 4 Mbit/s link,
router told 10 Gbps: 60 requests of 800-token prompts (210 KB states), 8 output tokens, 4 at
a time, under PrfaaS and forced local and remote; a 20 s outage under one request every
0.25 s for 45 s; 2% loss each way, 30 requests; unsigned ``/internal/*`` calls across the
namespaces. ``--quick``: 20 requests, an 8 s outage in 20 s, 10 under loss.
"""

from __future__ import annotations

import asyncio
import pathlib
import statistics
import tempfile

import httpx

from hyla.disagg.live.netlab.cluster import LabCluster, drive, p90
from hyla.disagg.live.netlab.hosts import NetLab

TOKENS, OUT = 800, 8


def load(lab, cl, n, start, force=None, **kw) -> tuple[dict, dict]:
    """A fresh router (told 10 Gbps, threshold 64), ``n`` requests from the decode side: their
    figures and the router's ``/cluster`` after."""
    cl.start_router(link_gbps=10.0, threshold=64, force=force)
    cl.wait_ready()
    res = lab.run_in("decode", lambda: asyncio.run(drive(
        cl.router_url, n, tokens=TOKENS, max_tokens=OUT, start=start, **kw)))
    e2e, ttft = [r["e2e_s"] for r in res], [r["ttft_s"] for r in res]
    view = cl.get("/cluster")
    link = next(iter(view["links"].values()), {})
    return {"requests": len(res), "ok": sum(r["status"] == "ok" for r in res),
            "lost": sum(r["status"] != "ok" for r in res),
            "ttft_p50_s": round(statistics.median([x for x in ttft if x is not None]), 3),
            "ttft_p90_s": round(p90(ttft), 3), "e2e_p50_s": round(statistics.median(e2e), 3),
            "e2e_p90_s": round(p90(e2e), 3),
            "e2e_p90_last_half_s": round(p90(e2e[len(e2e) // 2:]), 3),
            "max_e2e_s": round(max(e2e), 2), "over_5s": sum(x > 5.0 for x in e2e),
            "remote_ok": view["counts"]["remote_ok"], "probes": view["counts"]["probes"],
            "gbps_estimate": link.get("gbps_estimate"), "link_state": link.get("state")}, view


def outage(lab, cl, duration_s, cut_at, cut_for, interval=0.25) -> dict:
    seen: dict = {}

    async def tick(t):
        if "cut" not in seen and t >= cut_at:
            lab.set(down=True)
            seen["cut"] = t
        if "cut" in seen and "restored" not in seen and t >= cut_at + cut_for:
            lab.set(down=False)
            seen["restored"] = t
        if "cut" in seen:
            async with httpx.AsyncClient() as c:
                try:
                    v = (await c.get(cl.router_url + "/cluster", timeout=1)).json()
                    h = await c.get(cl.router_url + "/health", timeout=1)
                except httpx.HTTPError:
                    return
            states = [x["state"] for x in v["links"].values()]
            if "down" in states and "down" not in seen:
                seen["down"], seen["health"] = t, [h.status_code, h.json().get("status")]
            if "restored" in seen and "ok_again" not in seen and states == ["ok"]:
                seen["ok_again"] = t
    try:
        row, view = load(lab, cl, int(duration_s / interval), 5000, concurrency=16,
                         interval_s=interval, on_tick=tick)
    finally:
        lab.set(down=False)

    def after(event, since):
        return round(seen[event] - seen[since], 2) if event in seen else None
    return {"scenario": f"{cut_for:g} s outage", "policy": "prfaas", **row,
            "down_after_s": after("down", "cut"), "ok_after_restore_s": after("ok_again",
                                                                              "restored"),
            "health_while_down": seen.get("health"), "fallback_reasons": view["fallback_reasons"]}


def unsigned(lab, cl) -> dict:
    calls = {"prefill registry": (cl.prefill_url, "POST", "/internal/registry"),
             "prefill prefill": (cl.prefill_url, "POST", "/internal/prefill"),
             "prefill info": (cl.prefill_url, "GET", "/internal/info"),
             "decode generate": (cl.decode_url, "POST", "/internal/generate"),
             "decode info": (cl.decode_url, "GET", "/internal/info")}
    return {"scenario": "unsigned /internal/*", "status_codes": lab.run_in("decode", lambda: {
        name: httpx.request(method, url + path, timeout=10, json={
            "decode": ["tcp://10.77.0.1:9999"]} if method == "POST" else None).status_code
        for name, (url, method, path) in calls.items()})}


def main(run) -> None:
    if why := NetLab.why_not():
        raise SystemExit(f"disagg_link: cannot build the network namespaces: {why}")
    quick = run.args.quick
    n, rows = 20 if quick else 60, []
    lab = NetLab().start()
    lab.set(delay_s=0.005)
    cl = LabCluster(lab, pathlib.Path(tempfile.mkdtemp(prefix="hyla-link-")) / "roles.log")
    try:
        cl.start_workers()
        lab.shape(4.0)
        try:
            for k, policy in enumerate(("prfaas", "local", "remote")):
                run.progress(f"4 Mbit/s: {policy}")
                rows.append({"scenario": "4 Mbit/s, told 10 Gbps", "policy": policy, **load(
                    lab, cl, n, 1000 * (k + 1), policy if k else None, concurrency=4)[0]})
        finally:
            lab.shape(None)
        run.progress("outage")
        rows.append(outage(lab, cl, *((20, 4, 8) if quick else (45, 10, 20))))
        run.progress("loss")
        lab.set(loss=0.02)
        try:
            rows.append({"scenario": "2% loss", "policy": "prfaas", **load(
                lab, cl, 10 if quick else 30, 9000, concurrency=4)[0],
                "packets_dropped": lab.stats["dropped"]})
        finally:
            lab.set(loss=0.0)
        rows.append(unsigned(lab, cl))
    except BaseException:
        print(cl.tail())
        raise
    finally:
        cl.stop()
        lab.close()
    run.table("PrfaaS over the namespaces' link", [{k: r.get(k) for k in (
        "scenario", "policy", "ok", "lost", "ttft_p50_s", "e2e_p90_s", "e2e_p90_last_half_s",
        "over_5s", "remote_ok", "gbps_estimate", "down_after_s", "ok_after_restore_s")}
        for r in rows[:-1]])
    print(rows[-1])
    p, cut = {r["policy"]: r["e2e_p90_last_half_s"] for r in rows[:3]}, rows[3]
    run.save(rows, settings={"prompt_tokens": TOKENS, "output_tokens": OUT, "requests": n,
                             "one_way_delay_s": 0.005, "preset": "debug", "quick": quick},
             summary=f"4 Mbit/s, e2e p90 of the last half: PrfaaS {p['prfaas']:.3f} s, local "
                     f"{p['local']:.3f} s, remote {p['remote']:.3f} s; {cut['scenario']}: "
                     f"{cut['ok']}/{cut['requests']} completed, {cut['over_5s']} over 5 s")
