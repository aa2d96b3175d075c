"""Validate the PrfaaS simulator against the live CPU cluster: predicted vs measured
output throughput and TTFT p50 at three load levels (target: within 20%).

1. Measure the engine's step costs on this machine (debug preset, 1 torch thread, the
   workers' engine settings) with :func:`hyla.disagg.sim.profile.measure_engine_profile`:
   a prefill step's fixed cost and per-token speed, a decode step by batch width.
2. Start a live ``hyla cluster`` (1 prefill worker = the remote pool, 1 PD worker = the
   local pool, link throttled to ``--link-gbps``) and measure the serving path on the idle
   cluster with short probes: its CPU work per request and per streamed token (CPU time of
   the router, the workers and this client, less the decode engine's steps), the local
   path's fixed latency (HTTP hops, router, tokenizer) and the remote path's extra (a
   second worker, the transfer set-up). These are simulator inputs, like the link's
   bandwidth, measured before and apart from the loads being predicted.
3. For each request rate, replay the same slice of the Azure conversation trace
   (``azure-conv``, shipped with hyla; outputs scaled by ``--output-scale``) in
   PrfaaS mode; measure output tok/s (output tokens of completed requests / (last
   completion - first arrival)) and TTFT p50 (through the router, first streamed token).
4. Simulate the same topology (a colocated PD instance with the engine's chunking and
   prefix-cache cuts, a serial prefill instance) on this machine's cores (processor
   sharing of engine steps and serving work), with the profile, serving costs, link,
   threshold, policy, requests and arrivals.
5. Repeat 1-4 ``--repeats`` times a level; print the medians of predicted and measured
   with relative errors; write ``benchmarks/results/disagg_validate.json``. The engine-only
   prediction (no serving costs, no shared cores) is reported too.

    python benchmarks/disagg_validate.py [--rates 2,6,12] [--requests 40]

Caveats: the machine's speed drifts between runs (tens of percent); GIL contention inside
a worker and garbage-collection pauses are not modelled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from disagg_live import _request  # noqa: E402

from hyla.disagg.live.cluster import ClusterSpec, free_port, launch  # noqa: E402
from hyla.disagg.live.router.core import live_policy  # noqa: E402
from hyla.disagg.sim.hardware import InstanceProfile, spec_from_config  # noqa: E402
from hyla.disagg.sim.model import Deployment, Sim, SimConfig  # noqa: E402
from hyla.disagg.sim.workload import Request, describe, load_trace  # noqa: E402
from hyla.perf import print_table, write_results  # noqa: E402

TRACE = "azure-conv"  # the Azure conversation trace that ships with hyla
PROBE_LEN = 32
PROBES = 5
LONG_PROBE_TOKENS = 16      # extra streamed tokens of the probes that price a token


def measure_profile(preset_name: str, threads: int) -> dict:
    import torch

    from hyla.disagg.sim.profile import measure_engine_profile
    from hyla.model import HylaLM
    from hyla.model.config import preset

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = HylaLM(preset(preset_name)).eval()
    return {**measure_engine_profile(model, name=f"cpu-{threads}thread-engine"),
            "preset": preset_name}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live(reqs, args) -> dict:
    spec = ClusterSpec(preset=args.preset, port=free_port(), prefill_workers=1,
                       decode_workers=1, link_gbps=args.link_gbps, threshold=args.threshold,
                       max_model_len=args.max_len + 64, threads=args.threads,
                       max_num_seqs=args.max_num_seqs)
    cluster = launch(spec)
    try:
        base, out, local_probes, remote_probes = cluster.url, [], [], []
        view = httpx.get(f"{base}/cluster").json()
        pids = [view["router"]["pid"]] + [w["pid"] for w in view["workers"]]
        decode_url = [w for w in view["workers"] if w["role"] == "decode"][0]["address"]

        def serving_cpu_s() -> float:
            """CPU seconds of every process (router, workers, this client) minus the decode
            engine's steps: the serving path's CPU work."""
            steps = httpx.get(f"{decode_url}/internal/info",
                              auth=cluster.auth).json()["engine_stats"]
            return sum(map(_cpu_s, pids)) + time.process_time() - steps["step_time_s"]

        async def probe(client, n, sink, output_len=2):
            await _request(client, base, Request(rid=len(sink) + 1000, arrival=0.0,
                                                 prompt_len=n, output_len=output_len),
                           time.perf_counter(), sink)

        async def replay():
            async with httpx.AsyncClient(timeout=300) as client:
                # warm-up requests (first-call overheads on both paths), not counted
                await probe(client, PROBE_LEN, [])
                await probe(client, remote_probe_len(args), [])
                # the idle cluster's serving CPU per request and per streamed token, and
                # its fixed path latencies
                cpu = [serving_cpu_s()]
                for _ in range(PROBES):
                    await probe(client, PROBE_LEN, local_probes)
                cpu.append(serving_cpu_s())
                for _ in range(PROBES):
                    await probe(client, PROBE_LEN, [], output_len=2 + LONG_PROBE_TOKENS)
                cpu.append(serving_cpu_s())
                for _ in range(PROBES):
                    await probe(client, remote_probe_len(args), remote_probes)
                before = httpx.get(f"{base}/cluster").json()["counts"]["remote"]
                t0 = time.perf_counter()
                await asyncio.gather(*(_request(client, base, r, t0, out) for r in reqs))
                return before, cpu
        remote_before, cpu = asyncio.run(replay())
        view = httpx.get(f"{base}/cluster").json()
        pre = [w for w in view["workers"] if w["role"] == "prefill"][0]
        info = httpx.get(pre["address"] + "/internal/info", auth=cluster.auth).json()
    finally:
        cluster.stop()
    done = [o for o in out if o["ok"]]
    dur = max(o["end"] for o in done) - reqs[0].arrival
    ttfts = sorted(o["ttft"] for o in done)
    short, long_ = (cpu[1] - cpu[0]) / PROBES, (cpu[2] - cpu[1]) / PROBES
    token_cpu = max(0.0, (long_ - short) / LONG_PROBE_TOKENS)
    return {"completed": len(done), "output_tok_s": sum(o["output"] for o in done) / dur,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
            "duration_s": dur, "offloaded": view["counts"]["remote"] - remote_before,
            "fallbacks": view["counts"]["fallback_local"], "bytes_shipped": info["bytes_sent"],
            "final_threshold": view["policy"]["threshold"],
            "local_probe_ttft_s": statistics.median(p["ttft"] for p in local_probes),
            "remote_probe_ttft_s": statistics.median(p["ttft"] for p in remote_probes),
            "request_cpu_s": max(0.0, short - 2 * token_cpu), "token_cpu_s": token_cpu,
            "ttft_by_rid": {o["rid"]: o["ttft"] for o in done}}


def remote_probe_len(args) -> int:
    """A prompt the policy sends to the remote pool (over the threshold)."""
    return args.threshold + 256


def simulate(reqs, profile: dict, args, model, serving: dict | None = None) -> dict:
    """The live topology: a colocated PD instance (the PD worker) and a serial prefill
    instance (the prefill worker), chunked as the workers' engines chunk. ``serving``: the
    serving path's measured costs (latencies, CPU work); with them every instance and the
    serving work share this machine's cores."""
    prof = InstanceProfile(gpu="H20", gpus=1, measured=profile)
    dep = Deployment(name="live-topology", kind="prfaas", local=prof, local_instances=1,
                     local_prefill=0, colocated=True, remote=prof, remote_instances=1,
                     # the live router's policy knobs (queues within 0.1 s are balanced)
                     policy=live_policy(threshold=args.threshold, adapt=True))
    eng, sv = profile["engine"], serving or {}
    cfg = SimConfig(link_gbps=args.link_gbps, link_latency_s=sv.get("remote_extra_s", 0.0),
                    intra_gbps=1000.0, observe_s=0.5, max_num_seqs=args.max_num_seqs,
                    block_size=16, prefill_chunk=eng["max_num_batched_tokens"],
                    prefill_max_seqs=1, snapshot_interval=eng["snapshot_interval"],
                    # the PD worker's engine: enough blocks for max_num_seqs full sequences
                    kv_blocks=args.max_num_seqs * -(-(args.max_len + 64) // 16),
                    request_latency_s=sv.get("request_latency_s", 0.0),
                    host_cores=os.cpu_count() if serving else 0.0,
                    request_cpu_s=sv.get("request_cpu_s", 0.0),
                    token_cpu_s=sv.get("token_cpu_s", 0.0))
    m = Sim(model, dep, cfg).run(reqs)
    return {"completed": m["completed"], "output_tok_s": m["output_tok_s"],
            "ttft_p50_s": m["ttft_p50_s"], "ttft_p90_s": m["ttft_p90_s"],
            "duration_s": m["sim_seconds"],
            "offloaded": round(m["offload_fraction"] * len(reqs)),
            "bytes_shipped": m["egress_gbps"] * m["sim_seconds"] * 1e9 / 8,
            "final_threshold": m["threshold_final"], "busy": m["busy"]}


def serving_costs(meas: dict, profile: dict, args, model) -> dict:
    """The serving path's measured costs: CPU work per request and per streamed token, and
    the fixed latencies left once the simulator prices the idle probes with them."""
    cpu = {"request_cpu_s": meas["request_cpu_s"], "token_cpu_s": meas["token_cpu_s"]}

    def alone(n, **lat):
        return simulate([Request(rid=0, arrival=0.0, prompt_len=n, output_len=2)], profile,
                        args, model, cpu | lat)["ttft_p50_s"]
    request = max(0.0, meas["local_probe_ttft_s"] - alone(PROBE_LEN))
    remote = max(0.0, meas["remote_probe_ttft_s"]
                 - alone(remote_probe_len(args), request_latency_s=request))
    return cpu | {"request_latency_s": request, "remote_extra_s": remote}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="2,6,12",
                    help="req/s, comma list: three load levels (on this 2-core VM: 2 low, "
                         "6 medium, 12 where TTFT starts to climb; ~20-35 saturates)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3,
                    help="live runs a level (each with its own profile); medians reported")
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--output-scale", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=1536)
    ap.add_argument("--link-gbps", type=float, default=0.05, help="throttled link (50 Mbit/s)")
    ap.add_argument("--threshold", type=int, default=512)
    ap.add_argument("--sim-only", action="store_true", help="skip the live cluster")
    ap.add_argument("--results-name", default="disagg_validate",
                    help="benchmarks/results/NAME.json (other load levels keep the default's)")
    args = ap.parse_args()
    from hyla.model.config import preset

    t_start = time.perf_counter()
    import torch

    # the debug model runs in fp32: its attention KV ships as fp32
    model = spec_from_config(preset(args.preset), weight_dtype_bytes=4, kv_dtype=torch.float32)
    rows, detail = [], []
    for rate in [float(x) for x in args.rates.split(",")]:
        reqs = load_trace(TRACE, length_scale=args.length_scale,
                          output_scale=args.output_scale, rate=rate,
                          num_requests=args.requests, max_len=args.max_len)
        runs = []
        for k in range(args.repeats):
            # this VM's speed drifts by tens of percent within minutes: every prediction
            # uses a profile measured just before the live run it is compared with
            profile = measure_profile(args.preset, args.threads)
            bare = simulate(reqs, profile, args, model)
            meas = None if args.sim_only else live(reqs, args)
            lat = serving_costs(meas, profile, args, model) if meas else None
            pred = simulate(reqs, profile, args, model, lat) if lat else bare
            shown = {key: v for key, v in (meas or {}).items() if key != "ttft_by_rid"}
            print(f"rate {rate} repeat {k}: predicted {pred}\n  engine only {bare}\n"
                  f"  serving costs {lat}\n  measured {shown}", flush=True)
            runs.append({"profile": profile, "predicted": pred,
                         "predicted_without_serving_costs": bare, "serving_costs": lat,
                         "measured": meas})

        def med(kind, key, runs=runs):
            return statistics.median(r[kind][key] for r in runs)
        row = {"rate_req_s": rate, "pred_tok_s": med("predicted", "output_tok_s"),
               "pred_ttft_p50_s": med("predicted", "ttft_p50_s"),
               "pred_ttft_engine_only_s": med("predicted_without_serving_costs", "ttft_p50_s")}
        if not args.sim_only:
            row |= {"meas_tok_s": med("measured", "output_tok_s"),
                    "meas_ttft_p50_s": med("measured", "ttft_p50_s"),
                    "request_latency_s": med("serving_costs", "request_latency_s"),
                    "request_cpu_s": med("serving_costs", "request_cpu_s"),
                    "token_cpu_s": med("serving_costs", "token_cpu_s"),
                    "remote_extra_s": med("serving_costs", "remote_extra_s"),
                    "offload_pred": med("predicted", "offloaded"),
                    "offload_meas": med("measured", "offloaded")}
            row["tok_s_err"] = row["pred_tok_s"] / row["meas_tok_s"] - 1
            row["ttft_err"] = row["pred_ttft_p50_s"] / row["meas_ttft_p50_s"] - 1
            row["within_20pct"] = abs(row["tok_s_err"]) <= 0.2 and abs(row["ttft_err"]) <= 0.2
        detail.append({"rate_req_s": rate, "workload": describe(reqs), "runs": runs})
        rows.append(row)
    print_table(f"Simulator vs live cluster ({args.requests} trace requests a level, "
                f"link {args.link_gbps} Gbps, threshold {args.threshold}, {args.preset} "
                f"preset, {args.threads} thread)", rows)
    if not args.sim_only:
        path = write_results(args.results_name, rows, settings=vars(args),
                             model=model.to_dict(), detail=detail, trace=str(TRACE),
                             wall_s=time.perf_counter() - t_start,
                             note="all live processes share this machine's 2 CPU cores; the "
                                  "simulator's profile is the engine measured alone, and "
                                  "its path latencies come from idle probes")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
