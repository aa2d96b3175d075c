"""Live PrfaaS on one machine: the PrfaaS policy (long prompts remote, short ones local,
threshold adapted to measured egress and queues, local fallback when the remote pool is
saturated) vs all prefill local vs all prefill remote, through a throttled prefill ->
decode link: TTFT, end-to-end latency, requests offloaded, state shipped and egress,
measured end to end through the router.

Each mode starts a real ``hyla cluster`` (router + 1 prefill worker + 1 PD worker, each an
OS process with 1 torch thread; debug preset: random weights, byte tokenizer) and replays
the Azure conversation trace (``azure-conv``, shipped with hyla): prompt lengths
scaled by ``--length-scale``, outputs by ``--output-scale``, arrivals rescaled to
``--rate`` req/s, at each ``--link-gbps``. The modes run interleaved, ``--repeats`` times;
the table gives each metric's median over the repeats, and its ratio to all-local and to
all-remote at the same link.

On this 2-core VM the two workers, the router and this client share the cores: the
"remote" pool is the second core, which all-local leaves to the router and the client.
The default load (12 req/s, prompts x2) keeps the PD worker busy enough that moving long
prefills off it matters; at light load all three modes are alike.

    python benchmarks/disagg_live.py [--quick]

Writes ``benchmarks/results/disagg_live.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyla.disagg.live.cluster import ClusterSpec, free_port, launch  # noqa: E402
from hyla.disagg.sim.workload import load_trace  # noqa: E402
from hyla.perf import print_table, write_results  # noqa: E402

TRACE = "azure-conv"  # the Azure conversation trace that ships with hyla


async def _request(client, base, req, t0, out):
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    start = time.perf_counter()
    prompt = [(i * 7 + req.rid) % 250 + 1 for i in range(req.prompt_len)]
    body = {"prompt": prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    ttft, ok = None, False
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - start
                if line == "data: [DONE]":
                    ok = r.status_code == 200
    except httpx.HTTPError:
        pass
    now = time.perf_counter()
    out.append({"rid": req.rid, "ok": ok, "ttft": ttft, "e2e": now - start, "end": now - t0,
                "output": req.output_len, "prompt": req.prompt_len})


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_mode(name, force, args, reqs, link_gbps):
    spec = ClusterSpec(preset="debug", port=free_port(), prefill_workers=1, decode_workers=1,
                       link_gbps=link_gbps, threshold=args.threshold,
                       max_model_len=args.max_len + 64, force_path=force, threads=1)
    cluster = launch(spec)
    try:
        base = cluster.url
        out: list = []

        async def replay():
            async with httpx.AsyncClient(timeout=300) as client:
                t0 = time.perf_counter()
                await asyncio.gather(*(_request(client, base, r, t0, out) for r in reqs))
        t = time.perf_counter()
        asyncio.run(replay())
        wall = time.perf_counter() - t
        view = httpx.get(f"{base}/cluster").json()
        pre = [w for w in view["workers"] if w["role"] == "prefill"][0]
        info = httpx.get(pre["address"] + "/internal/info", auth=cluster.auth).json()
    finally:
        cluster.stop()
    ttfts = [o["ttft"] for o in out if o["ok"]]
    return {"mode": name, "requests": len(reqs), "completed": sum(o["ok"] for o in out),
            "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9),
            "e2e_mean_s": statistics.fmean(o["e2e"] for o in out),
            "offloaded": view["counts"]["remote"], "fallbacks": view["counts"]["fallback_local"],
            "state_MB_shipped": info["bytes_sent"] / 1e6,
            "egress_gbps_avg": info["bytes_sent"] * 8 / wall / 1e9,
            "final_threshold": view["policy"]["threshold"], "wall_s": wall}


MODES = (("prfaas", None), ("all-local", "local"), ("all-remote", "remote"))
MEDIAN_KEYS = ("completed", "ttft_p50_s", "ttft_p90_s", "e2e_mean_s", "offloaded",
               "fallbacks", "state_MB_shipped", "egress_gbps_avg", "final_threshold", "wall_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 requests, 1 repeat")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--length-scale", type=float, default=2.0)
    ap.add_argument("--output-scale", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--link-gbps", default="0.04,0.07,0.1",
                    help="throttled links to compare at, comma list (Gbps; default 40, 70 and "
                         "100 Mbit/s)")
    ap.add_argument("--threshold", type=int, default=512)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 30, 1
    reqs = load_trace(TRACE, length_scale=args.length_scale, output_scale=args.output_scale,
                      rate=args.rate, num_requests=args.requests, max_len=args.max_len)
    links = [float(x) for x in args.link_gbps.split(",")]
    runs = [run_mode(name, force, args, reqs, link) | {"repeat": k, "link_gbps": link}
            for link in links for k in range(args.repeats) for name, force in MODES]
    rows = []
    for link in links:
        group = [{"link_gbps": link, "mode": name, "requests": len(reqs),
                  **{key: statistics.median(r[key] for r in runs
                                            if r["mode"] == name and r["link_gbps"] == link)
                     for key in MEDIAN_KEYS}} for name, _ in MODES]
        base = {r["mode"]: r for r in group}
        for r in group:
            for key in ("ttft_p50_s", "ttft_p90_s", "e2e_mean_s"):
                r[f"{key[:-2]}_vs_local"] = r[key] / base["all-local"][key]
                r[f"{key[:-2]}_vs_remote"] = r[key] / base["all-remote"][key]
        rows += group
    print_table(f"Live PrfaaS on this machine: {len(reqs)} conversation-trace requests at "
                f"{args.rate} req/s, prompts x{args.length_scale} (debug preset; medians of "
                f"{args.repeats})", rows)
    path = write_results("disagg_live", rows, settings=vars(args), trace=str(TRACE),
                         runs=runs,
                         note="all workers, the router and the client share this machine's "
                              "2 CPU cores; debug preset (random weights)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
