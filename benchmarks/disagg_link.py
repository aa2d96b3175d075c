"""The PrfaaS cluster on a real link (issue 30): two network namespaces on this machine
(prefill worker | decode worker + router), the prefill -> decode link shaped by the
kernel's token bucket (``tc tbf``) and cut, delayed or made lossy by a forwarder
(:mod:`hyla.disagg.live.netlab`; this kernel has no ``netem``). Debug preset (random
weights, byte tokenizer), one torch thread a process. Root only.

Scenarios:

- **slow link**: 4 Mbit/s, the router told 10 Gbps (``--link-gbps 10``, as the README
  starts it). 60 requests of 800-token prompts (a 210 KB state each: 0.42 s at 4 Mbit/s)
  and 8 output tokens, 4 at a time, under each policy: ``prfaas`` (adaptive, the
  measured link), forced ``local`` and forced ``remote``. TTFT and end-to-end latency
  (p50, p90) over all 60 and the p90 of the last 30.
- **outage**: an unshaped link (5 ms each way), one request every 0.25 s for 45 s, the
  link cut for 20 s from t = 10 s: seconds until ``/cluster`` shows the path ``down``,
  until it is ``ok`` again after the link returns, requests over 5 s, requests lost.
- **2% loss**: 30 requests on the unshaped link losing 2% of packets each way.
- **closed control plane**: unsigned ``/internal/*`` calls across the namespaces.

    sudo python benchmarks/disagg_link.py [--quick]

Writes ``benchmarks/results/disagg_link.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyla.disagg.live.netlab.cluster import LabCluster, drive, p90  # noqa: E402
from hyla.disagg.live.netlab.hosts import NetLab  # noqa: E402
from hyla.perf import print_table, write_results  # noqa: E402

TOKENS, OUT = 800, 8


def _stats(res: list[dict]) -> dict:
    e2e = [r["e2e_s"] for r in res]
    ttft = [r["ttft_s"] for r in res]
    half = e2e[len(e2e) // 2:]
    return {"requests": len(res), "ok": sum(r["status"] == "ok" for r in res),
            "ttft_p50_s": round(statistics.median([x for x in ttft if x is not None]), 3),
            "ttft_p90_s": round(p90(ttft), 3),
            "e2e_p50_s": round(statistics.median(e2e), 3), "e2e_p90_s": round(p90(e2e), 3),
            "e2e_p90_last_half_s": round(p90(half), 3)}


def slow_link(lab, cl, n: int) -> list[dict]:
    rows = []
    lab.shape(4.0)
    try:
        for k, policy in enumerate(("prfaas", "local", "remote")):
            cl.start_router(link_gbps=10.0, threshold=64,
                            force=None if policy == "prfaas" else policy)
            cl.wait_ready()
            res = lab.run_in("decode", lambda k=k: asyncio.run(drive(
                cl.router_url, n, tokens=TOKENS, max_tokens=OUT, concurrency=4,
                start=1000 * (k + 1))))
            view = cl.get("/cluster")
            (link,) = view["links"].values() or [{}]
            rows.append({"scenario": "4 Mbit/s, told 10 Gbps", "policy": policy,
                         **_stats(res), "remote_ok": view["counts"]["remote_ok"],
                         "probes": view["counts"]["probes"],
                         "gbps_estimate": link.get("gbps_estimate"),
                         "link_state": link.get("state")})
            print(rows[-1], flush=True)
    finally:
        lab.shape(None)
    return rows


def outage(lab, cl, duration_s: float, cut_at: float, cut_for: float,
           interval: float) -> dict:
    cl.start_router(link_gbps=10.0, threshold=64)
    cl.wait_ready()
    seen: dict = {}
    n = int(duration_s / interval)

    def run():
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
                    seen["down"] = t
                    seen["health"] = [h.status_code, h.json().get("status")]
                if "restored" in seen and "ok_again" not in seen and states == ["ok"]:
                    seen["ok_again"] = t
        return asyncio.run(drive(cl.router_url, n, tokens=TOKENS, max_tokens=OUT,
                                 concurrency=16, interval_s=interval, start=5000,
                                 on_tick=tick))
    try:
        res = lab.run_in("decode", run)
    finally:
        lab.set(down=False)
    view = cl.get("/cluster")
    e2e = [r["e2e_s"] for r in res]
    return {"scenario": f"{cut_for:g} s outage", "policy": "prfaas", **_stats(res),
            "lost": sum(r["status"] != "ok" for r in res),
            "over_5s": sum(x > 5.0 for x in e2e), "max_e2e_s": round(max(e2e), 2),
            "down_after_s": None if "down" not in seen
            else round(seen["down"] - seen["cut"], 2),
            "ok_after_restore_s": None if "ok_again" not in seen
            else round(seen["ok_again"] - seen["restored"], 2),
            "health_while_down": seen.get("health"),
            "fallback_reasons": view["fallback_reasons"], "remote_ok": view["counts"]["remote_ok"]}


def loss(lab, cl, n: int) -> dict:
    cl.start_router(link_gbps=10.0, threshold=64)
    cl.wait_ready()
    lab.set(loss=0.02)
    try:
        res = lab.run_in("decode", lambda: asyncio.run(drive(
            cl.router_url, n, tokens=TOKENS, max_tokens=OUT, concurrency=4, start=9000)))
    finally:
        lab.set(loss=0.0)
    view = cl.get("/cluster")
    (link,) = view["links"].values()
    return {"scenario": "2% loss", "policy": "prfaas", **_stats(res),
            "lost": sum(r["status"] != "ok" for r in res),
            "remote_ok": view["counts"]["remote_ok"], "link_state": link["state"],
            "packets_dropped": lab.stats["dropped"]}


def unsigned(lab, cl) -> dict:
    def probe():
        out = {}
        for name, url, method, path in (
                ("prefill registry", cl.prefill_url, "POST", "/internal/registry"),
                ("prefill prefill", cl.prefill_url, "POST", "/internal/prefill"),
                ("prefill info", cl.prefill_url, "GET", "/internal/info"),
                ("decode generate", cl.decode_url, "POST", "/internal/generate"),
                ("decode info", cl.decode_url, "GET", "/internal/info")):
            out[name] = httpx.request(method, url + path, timeout=10,
                                      json={"decode": ["tcp://10.77.0.1:9999"]}
                                      if method == "POST" else None).status_code
        return out
    return {"scenario": "unsigned /internal/*", "status_codes": lab.run_in("decode", probe)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer requests and a shorter outage (default: off)")
    args = ap.parse_args()
    why = NetLab.why_not()
    if why:
        sys.exit(f"disagg_link: cannot build the network namespaces: {why}")
    n = 20 if args.quick else 60
    lab = NetLab().start()
    lab.set(delay_s=0.005)
    cl = LabCluster(lab, pathlib.Path(tempfile.mkdtemp(prefix="hyla-link-")) / "roles.log")
    t0 = time.monotonic()
    try:
        cl.start_workers()
        cl.start_router()
        cl.wait_ready()
        rows = slow_link(lab, cl, n)
        out_row = outage(lab, cl, *((20, 4, 8, 0.25) if args.quick else (45, 10, 20, 0.25)))
        print(out_row, flush=True)
        loss_row = loss(lab, cl, 10 if args.quick else 30)
        print(loss_row, flush=True)
        auth_row = unsigned(lab, cl)
        print(auth_row, flush=True)
    except BaseException:
        print(cl.tail())
        raise
    finally:
        cl.stop()
        lab.close()
    print_table(f"4 Mbit/s link, router told 10 Gbps ({n} requests, 4 at a time)", [
        {k: r[k] for k in ("policy", "ok", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s",
                           "e2e_p90_s", "e2e_p90_last_half_s", "remote_ok", "probes",
                           "gbps_estimate")} for r in rows])
    print_table("outage (prfaas)", [
        {k: out_row[k] for k in ("scenario", "requests", "ok", "lost", "over_5s", "max_e2e_s",
                                 "down_after_s", "ok_after_restore_s", "e2e_p90_s")}])
    print_table("2% packet loss (prfaas)", [
        {k: loss_row[k] for k in ("requests", "ok", "lost", "e2e_p50_s", "e2e_p90_s",
                                  "remote_ok", "link_state", "packets_dropped")}])
    print(auth_row)
    path = write_results("disagg_link", rows + [out_row, loss_row, auth_row],
                         settings={"prompt_tokens": TOKENS, "output_tokens": OUT,
                                   "requests": n, "one_way_delay_s": 0.005,
                                   "preset": "debug", "quick": args.quick},
                         wall_s=round(time.monotonic() - t0, 1))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
