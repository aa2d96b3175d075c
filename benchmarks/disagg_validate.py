"""The PrfaaS simulator predicts the live CPU cluster's output tok/s and TTFT p50 within 20%.

Per rate, ``--repeats`` times: the engine's step costs measured here (debug preset, one
thread); a live ``hyla cluster`` (1 prefill + 1 PD worker, 50 Mbit/s, threshold 512), its
serving path priced by probes on the idle cluster, replaying 40 Azure trace requests; the
same simulated with that profile and those costs. ``--quick``: 10 requests, one repeat.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

import httpx
import torch

from benchmarks.disagg_common import TRACE, replay, request
from hyla.disagg.live.cluster import ClusterSpec, free_port
from hyla.disagg.live.router.core import live_policy
from hyla.disagg.sim.hardware import InstanceProfile, spec_from_config
from hyla.disagg.sim.model import Deployment, Sim, SimConfig
from hyla.disagg.sim.profile import measure_engine_profile
from hyla.disagg.sim.workload import Request, describe, load_trace
from hyla.model import HylaLM
from hyla.model.config import preset

SET = {"preset": "debug", "max_num_seqs": 16, "output_scale": 0.1, "max_len": 1536,
       "link_gbps": 0.05, "threshold": 512}
PROBE, PROBES, PROBE_TOKENS = 32, 5, 16     # prompt, probes a kind, extra streamed tokens
REMOTE_PROBE = SET["threshold"] + 256       # over the threshold: the remote pool


def add_args(parser) -> None:
    parser.add_argument("--rates", default="2,6,12",
                        help="req/s, comma list (on 2 cores: 12 where TTFT starts to climb, "
                             "~20-35 saturates)")
    parser.add_argument("--results-name", default=None, help="results file stem")


def measure_profile(threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return measure_engine_profile(HylaLM(preset(SET["preset"])).eval(),
                                  name=f"cpu-{threads}thread-engine") | {"preset": SET["preset"]}


def cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live(reqs, threads: int) -> dict:
    spec = ClusterSpec(preset=SET["preset"], port=free_port(), prefill_workers=1,
                       decode_workers=1, link_gbps=SET["link_gbps"], threshold=SET["threshold"],
                       max_model_len=SET["max_len"] + 64, threads=threads,
                       max_num_seqs=SET["max_num_seqs"])
    local, remote = [], []

    async def probes(client, cluster):
        view = httpx.get(f"{cluster.url}/cluster").json()
        pids = [view["router"]["pid"]] + [w["pid"] for w in view["workers"]]
        decode = next(w for w in view["workers"] if w["role"] == "decode")["address"]

        def serving_cpu_s() -> float:   # every process's CPU less the decode engine's steps
            info = httpx.get(f"{decode}/internal/info", auth=cluster.auth).json()
            return (sum(map(cpu_s, pids)) + time.process_time()
                    - info["engine_stats"]["step_time_s"])

        async def probe(n, sink, output_len=2):
            await request(client, cluster.url, Request(rid=len(sink) + 1000, arrival=0.0,
                          prompt_len=n, output_len=output_len), time.perf_counter(), sink)
        await probe(PROBE, [])              # first-call overheads on both paths, not counted
        await probe(REMOTE_PROBE, [])
        cpu = [serving_cpu_s()]
        for n, sink, out in ((PROBE, local, 2), (PROBE, [], 2 + PROBE_TOKENS),
                             (REMOTE_PROBE, remote, 2)):
            for _ in range(PROBES):
                await probe(n, sink, out)
            cpu.append(serving_cpu_s())
        return cpu, httpx.get(f"{cluster.url}/cluster").json()["counts"]["remote"]
    r = replay(spec, reqs, probes)
    (cpu, remote_before), counts = r["warm"], r["view"]["counts"]
    done = [o for o in r["out"] if o["ok"]]
    ttfts, dur = sorted(o["ttft"] for o in done), max(o["end"] for o in done) - reqs[0].arrival
    short, long_ = (cpu[1] - cpu[0]) / PROBES, (cpu[2] - cpu[1]) / PROBES
    token_cpu = max(0.0, (long_ - short) / PROBE_TOKENS)
    return {"completed": len(done), "output_tok_s": sum(o["output"] for o in done) / dur,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
            "duration_s": dur, "offloaded": counts["remote"] - remote_before,
            "fallbacks": counts["fallback_local"], "bytes_shipped": r["info"]["bytes_sent"],
            "final_threshold": r["view"]["policy"]["threshold"],
            "local_probe_ttft_s": statistics.median(p["ttft"] for p in local),
            "remote_probe_ttft_s": statistics.median(p["ttft"] for p in remote),
            "request_cpu_s": max(0.0, short - 2 * token_cpu), "token_cpu_s": token_cpu}


def simulate(reqs, profile: dict, model, sv: dict | None = None) -> dict:
    """A colocated PD instance and a serial prefill instance, chunked as the workers'
    engines chunk; with ``sv`` (the serving path's costs) all share this machine's cores."""
    prof, eng, seqs, sv = InstanceProfile(gpu="H20", gpus=1, measured=profile), \
        profile["engine"], SET["max_num_seqs"], sv or {}
    dep = Deployment(name="live-topology", kind="prfaas", local=prof, local_instances=1,
                     local_prefill=0, colocated=True, remote=prof, remote_instances=1,
                     policy=live_policy(threshold=SET["threshold"], adapt=True))
    cfg = SimConfig(link_gbps=SET["link_gbps"], link_latency_s=sv.get("remote_extra_s", 0.0),
                    intra_gbps=1000.0, observe_s=0.5, max_num_seqs=seqs, block_size=16,
                    prefill_chunk=eng["max_num_batched_tokens"], prefill_max_seqs=1,
                    snapshot_interval=eng["snapshot_interval"],
                    kv_blocks=seqs * -(-(SET["max_len"] + 64) // 16),  # as the PD worker's
                    host_cores=os.cpu_count() if sv else 0.0,
                    **{k: sv.get(k, 0.0) for k in ("request_latency_s", "request_cpu_s",
                                                   "token_cpu_s")})
    m = Sim(model, dep, cfg).run(reqs)
    return {**{k: m[k] for k in ("completed", "output_tok_s", "ttft_p50_s", "ttft_p90_s",
                                 "busy")}, "duration_s": m["sim_seconds"],
            "offloaded": round(m["offload_fraction"] * len(reqs)),
            "bytes_shipped": m["egress_gbps"] * m["sim_seconds"] * 1e9 / 8,
            "final_threshold": m["threshold_final"]}


def serving_costs(meas: dict, profile: dict, model) -> dict:
    """The measured CPU work, and the latencies left once the simulator prices the idle
    probes with it."""
    cpu = {k: meas[k] for k in ("request_cpu_s", "token_cpu_s")}

    def alone(n, **lat):
        return simulate([Request(rid=0, arrival=0.0, prompt_len=n, output_len=2)], profile,
                        model, cpu | lat)["ttft_p50_s"]
    req = max(0.0, meas["local_probe_ttft_s"] - alone(PROBE))
    return cpu | {"request_latency_s": req, "remote_extra_s": max(
        0.0, meas["remote_probe_ttft_s"] - alone(REMOTE_PROBE, request_latency_s=req))}


def main(run) -> None:
    a, threads = run.args, run.args.threads or 1
    n, repeats = (10, 1) if a.quick else (40, a.repeats)
    # the debug model runs in fp32: its attention KV ships as fp32
    model = spec_from_config(preset(SET["preset"]), weight_dtype_bytes=4,
                             kv_dtype=torch.float32)
    rows, detail = [], []
    for rate in [float(x) for x in a.rates.split(",")]:
        reqs = load_trace(TRACE, output_scale=SET["output_scale"], rate=rate, num_requests=n,
                          max_len=SET["max_len"])
        runs = []
        for k in range(repeats):
            run.progress(f"rate {rate}, repeat {k + 1}")
            # the machine's speed drifts within minutes: each prediction uses a profile
            # measured just before the live run it is compared with
            profile = measure_profile(threads)
            bare, meas = simulate(reqs, profile, model), live(reqs, threads)
            lat = serving_costs(meas, profile, model)
            runs.append({"profile": profile, "predicted": simulate(reqs, profile, model, lat),
                         "predicted_without_serving_costs": bare, "serving_costs": lat,
                         "measured": meas})

        def med(kind, key, runs=runs):
            return statistics.median(r[kind][key] for r in runs)
        row = {"rate_req_s": rate, "pred_tok_s": med("predicted", "output_tok_s"),
               "pred_ttft_p50_s": med("predicted", "ttft_p50_s"),
               "pred_ttft_engine_only_s": med("predicted_without_serving_costs", "ttft_p50_s"),
               "meas_tok_s": med("measured", "output_tok_s"),
               "meas_ttft_p50_s": med("measured", "ttft_p50_s"),
               **{k: med("serving_costs", k) for k in runs[0]["serving_costs"]},
               "offload_pred": med("predicted", "offloaded"),
               "offload_meas": med("measured", "offloaded")}
        row["tok_s_err"] = row["pred_tok_s"] / row["meas_tok_s"] - 1
        row["ttft_err"] = row["pred_ttft_p50_s"] / row["meas_ttft_p50_s"] - 1
        row["within_20pct"] = abs(row["tok_s_err"]) <= 0.2 and abs(row["ttft_err"]) <= 0.2
        detail.append({"rate_req_s": rate, "workload": describe(reqs), "runs": runs})
        rows.append(row)
    run.table(f"Simulator vs live cluster ({n} trace requests a rate, {repeats} runs)", rows)
    run.save(rows, name=a.results_name, model=model.to_dict(), detail=detail, trace=TRACE,
             settings=SET | {"requests": n, "repeats": repeats, "threads": threads},
             summary="predicted vs measured output tok/s, TTFT p50: " + ", ".join(
                 f"{r['rate_req_s']:g} req/s {r['tok_s_err']:+.1%}, {r['ttft_err']:+.1%}"
                 for r in rows),
             note="all live processes share this machine's cores; the simulator's profile "
                  "is the engine measured alone, its path latencies come from idle probes")
