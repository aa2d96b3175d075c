"""Live PrfaaS on one machine beats all-local and all-remote prefill on TTFT and latency.

Per ``--link-gbps`` (a throttled prefill -> decode link) and mode (the PrfaaS policy, every
prefill forced local, every prefill forced remote), interleaved ``--repeats`` times: a real
``hyla cluster`` (router, 1 prefill and 1 PD worker, one torch thread each, debug preset)
replays the Azure conversation trace (prompts x2, outputs x0.1, up to 3K tokens) at
``--rate``; medians of TTFT, latency, offloads and state shipped, with ratios to all-local
and all-remote. ``--quick``: 30 requests, one repeat.
"""

from __future__ import annotations

import statistics

from benchmarks.disagg_common import TRACE, replay
from hyla.disagg.live.cluster import ClusterSpec, free_port
from hyla.disagg.sim.workload import load_trace

MAX_LEN, THRESHOLD = 3072, 512
MODES = {"prfaas": None, "all-local": "local", "all-remote": "remote"}


def add_args(parser) -> None:
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=12.0, help="req/s (default 12)")
    parser.add_argument("--link-gbps", default="0.04,0.07,0.1",
                        help="throttled links, comma list (default 40, 70, 100 Mbit/s)")


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_mode(mode, reqs, link) -> dict:
    r = replay(ClusterSpec(preset="debug", port=free_port(), prefill_workers=1,
                           decode_workers=1, link_gbps=link, threshold=THRESHOLD, threads=1,
                           max_model_len=MAX_LEN + 64, force_path=MODES[mode]), reqs)
    out, counts, sent = r["out"], r["view"]["counts"], r["info"]["bytes_sent"]
    ttfts = [o["ttft"] for o in out if o["ok"]]
    return {"completed": sum(o["ok"] for o in out), "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p90_s": pct(ttfts, 0.9), "e2e_mean_s": statistics.fmean(o["e2e"] for o in out),
            "offloaded": counts["remote"], "fallbacks": counts["fallback_local"],
            "state_MB_shipped": sent / 1e6, "egress_gbps_avg": sent * 8 / r["wall"] / 1e9,
            "final_threshold": r["view"]["policy"]["threshold"], "wall_s": r["wall"]}


def main(run) -> None:
    a = run.args
    n, repeats = (30, 1) if a.quick else (a.requests, a.repeats)
    reqs = load_trace(TRACE, length_scale=2.0, output_scale=0.1, rate=a.rate, num_requests=n,
                      max_len=MAX_LEN)
    runs, rows = [], []
    for link in [float(x) for x in a.link_gbps.split(",")]:
        for k in range(repeats):
            for mode in MODES:
                run.progress(f"{link} Gbps, repeat {k + 1}: {mode}")
                runs.append({"link_gbps": link, "mode": mode, "repeat": k,
                             **run_mode(mode, reqs, link)})
        group = {m: {"link_gbps": link, "mode": m, "requests": len(reqs), **{
            key: statistics.median(r[key] for r in runs if (r["mode"], r["link_gbps"]) == (m, link))
            for key in runs[-1] if key not in ("link_gbps", "mode", "repeat")}} for m in MODES}
        for row in group.values():
            for key in ("ttft_p50_s", "ttft_p90_s", "e2e_mean_s"):
                row[f"{key[:-2]}_vs_local"] = row[key] / group["all-local"][key]
                row[f"{key[:-2]}_vs_remote"] = row[key] / group["all-remote"][key]
        rows += group.values()
    run.table(f"Live PrfaaS: {n} trace requests at {a.rate} req/s (medians of {repeats})", rows)
    p = rows[-3]    # PrfaaS at the last link
    run.save(rows, runs=runs, trace=TRACE, settings={"requests": n, "repeats": repeats,
             "rate": a.rate, "length_scale": 2.0, "output_scale": 0.1, "max_len": MAX_LEN,
             "threshold": THRESHOLD}, note="router, workers and client share this machine's "
             "cores; debug preset (random weights)",
             summary=f"PrfaaS at {p['link_gbps'] * 1e3:g} Mbit/s vs all-local / all-remote: TTFT "
                     f"p50 {p['ttft_p50_vs_local']:.2f}x / {p['ttft_p50_vs_remote']:.2f}x, mean "
                     f"e2e {p['e2e_mean_vs_local']:.2f}x / {p['e2e_mean_vs_remote']:.2f}x")
