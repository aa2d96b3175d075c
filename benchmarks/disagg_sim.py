"""At the published case study's scale, PrfaaS out-serves homogeneous PD and naive offloading.

Simulated, not measured (the roofline cost model and the assumptions the JSON lists). Per
study: a grid of homogeneous PD's P/D split and of PrfaaS's (static threshold, local prefill
instances) ranked by goodput; each deployment's capacity (highest rate with 90% of requests
within the SLOs) at its best, PrfaaS with the adaptive threshold; TTFT at a common rate.
Studies: ``published`` (datasheet MFU), ``calibrated`` (the H200 prefill MFU fitted so that
naive serves the published 1.16x homogeneous) and ``azure`` (conversation trace, prompts x8).
``--quick``: a smaller grid, fewer requests.
"""

from __future__ import annotations

import dataclasses
import textwrap

from benchmarks.disagg_common import TRACE, out_dir, pyplot
from hyla.disagg.sim.capacity import fit_remote_mfu
from hyla.disagg.sim.hardware import InstanceProfile, published_1t_hybrid
from hyla.disagg.sim.model import SimConfig
from hyla.disagg.sim.report import best_of, grid, simulate_one
from hyla.disagg.sim.setups import (
    PUBLISHED_INPUTS,
    PUBLISHED_NAIVE_VS_HOMOGENEOUS,
    compare,
    published_deployments,
    with_rate_range,
    workload_maker,
)
from hyla.disagg.sim.workload import describe

NAMES = ("homogeneous", "naive", "prfaas")


def add_args(parser) -> None:
    parser.add_argument("--studies", default="published,calibrated,azure", help="comma list")


def study(run, key, make, rates, thresholds, homo_splits, splits, common_rate) -> dict:
    model, cfg, calib = published_1t_hybrid(), SimConfig(), None
    mfu = InstanceProfile(gpu="H200").mfu
    bh = best_of(g_h := grid(model, published_deployments()["homogeneous"], cfg,
                             make(rates[0]), None, homo_splits))
    if key == "calibrated":
        calib = fit_remote_mfu(model, published_deployments(), lambda seed: make, [0], cfg,
                               target=PUBLISHED_NAIVE_VS_HOMOGENEOUS,
                               progress=lambda m: run.progress(f"{key}: {m}"))
        mfu = calib["remote_mfu"]   # then grid PrfaaS a little above naive's capacity
        rates = (rates[0], 1.3 * calib["ratio"]["mean"] * calib["homogeneous"]["mean"])
    prfaas = published_deployments(remote_mfu=mfu)["prfaas"]
    static = dataclasses.replace(prfaas, policy=dataclasses.replace(prfaas.policy, adapt=False))
    bp = best_of(g_p := grid(model, static, cfg, make(rates[1]), thresholds, splits))
    best = {"homo_prefill": bh["local_prefill"], "prfaas_prefill": bp["local_prefill"],
            "threshold": bp["threshold"]}
    run.progress(f"{key}: grid done, best {best}")
    deps = published_deployments(remote_mfu=mfu, **best)
    res = compare(model, deps, make, cfg=cfg, rate_range=with_rate_range(model, deps),
                  progress=lambda n: run.progress(f"{key}: capacity of {n}"))
    return {"workload": describe(make(1.0)), "grid_homogeneous": g_h, "grid_prfaas": g_p,
            "best": best, "remote_mfu": mfu, "calibration": calib, "capacity": res,
            "common_rate": common_rate,
            "at_common_rate": {n: simulate_one(model, d, cfg, make(common_rate))
                               for n, d in deps.items()}}


def plot(path, studies: dict) -> None:
    """Throughput at capacity by deployment and study; a heatmap a study of PrfaaS goodput
    over (threshold, local prefill instances)."""
    plt, n, w = pyplot(), 1 + len(studies), 0.8 / len(studies)
    fig, axes = plt.subplots((n + 1) // 2, 2, figsize=(12, 4.6 * ((n + 1) // 2)), squeeze=False)
    bars, *heat = axes.ravel()
    for k, (label, st) in enumerate(studies.items()):
        ds = st["capacity"]["deployments"]
        bars.bar([i + w * k for i in range(3)], [ds[d]["throughput_tok_s"] / 1e3 for d in NAMES],
                 w, label=label)
    bars.set(xticks=[i + 0.4 - w / 2 for i in range(3)], xticklabels=NAMES,
             ylabel="throughput at capacity (k tok/s)")
    bars.set_title("Each deployment at its capacity under the SLOs", fontsize=10)
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    for ax, (label, st) in zip(heat, studies.items(), strict=False):
        g = {(r["threshold"], r["local_prefill"]): r["goodput_req_s"] for r in st["grid_prfaas"]}
        ts, ns = sorted({t for t, _ in g}), sorted({s for _, s in g})
        fig.colorbar(ax.imshow([[g.get((t, s), 0) for s in ns] for t in ts], origin="lower",
                               aspect="auto", cmap="viridis"), ax=ax)
        ax.set(xticks=range(len(ns)), xticklabels=ns, yticks=range(len(ts)),
               yticklabels=[f"{t / 1000:g}K" for t in ts], ylabel="threshold t (static)",
               xlabel="local prefill instances (of 8)")
        ax.set_title("\n".join(textwrap.wrap(f"PrfaaS goodput (req/s): {label}", 48)),
                     fontsize=10)
    for ax in heat[len(studies):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(run) -> None:
    quick = run.args.quick
    n, splits = (200, [3, 4, 5]) if quick else (300, [2, 3, 4, 5, 6])
    ts = [12_000, 19_400, 28_000] if quick else [8_000, 12_000, 16_000, 19_400, 24_000, 32_000]
    synthetic = workload_maker(num_requests=n)
    setups = {  # label, workload, grid rates, thresholds, homogeneous splits, common rate
        "published": ("published (synthetic workload)", synthetic, (1.6, 4.6), ts,
                      [9, 10, 11], 1.0),
        "calibrated": ("published, H200 MFU calibrated to naive = 1.16x homogeneous",
                       synthetic, (1.6, 4.6), ts, [9, 10, 11], 1.0),
        "azure": ("azure conv x8 (trace)", workload_maker(    # short outputs: more requests
            trace=TRACE, length_scale=8, arrivals="trace", num_requests=4 * n), (3.2, 34.0),
            [4_000, 8_000, 16_000] if quick else [4_000, 8_000, 12_000, 19_400], [8, 9, 10], 3.0)}
    studies, rows, ratios = {}, [], []
    for key in run.args.studies.split(","):
        label, make, rates, thresholds, homo, common = setups[key]
        st = studies[label] = study(run, key, make, rates, thresholds, homo, splits, common)
        for name, m in st["capacity"]["deployments"].items():
            rows.append({"workload": label, "deployment": name, "h200_mfu": st["remote_mfu"],
                         **{k: m[k] for k in ("capacity_req_s", "throughput_tok_s",
                                              "goodput_req_s", "ttft_p50_s", "ttft_p90_s",
                                              "egress_gbps")},
                         "tpot_p90_ms": m["tpot_p90_s"] * 1e3, "offload": m["offload_fraction"],
                         "t_final": m["threshold_final"], f"ttft_p90_at_{common:g}_s":
                         st["at_common_rate"][name]["ttft_p90_s"]})
        r = st["capacity"]["ratios"]
        ratios.append(f"{key} {r['prfaas_vs_homogeneous']:.2f}x / {r['prfaas_vs_naive']:.2f}x")
    run.table("Deployments at capacity (TTFT/TPOT SLOs, 90% of requests)", rows)
    plot(png := out_dir(run) / f"disagg_sim{'_quick' if quick else ''}.png", studies)
    run.save(rows, studies=studies, inputs=PUBLISHED_INPUTS, png=png.name,
             ratios={label: st["capacity"]["ratios"] for label, st in studies.items()},
             model=published_1t_hybrid().to_dict(), sim_config=dataclasses.asdict(SimConfig()),
             summary="PrfaaS vs homogeneous PD / naive: " + ", ".join(ratios),
             note="simulated, not measured: roofline cost model + assumptions")
