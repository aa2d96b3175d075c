"""PrfaaS's searched policy stays >= 0.97x its better baseline, >= 1.1x in the paper's conditions.

Simulated capacities under the SLOs (the published setup's 96-GPU deployments; PrfaaS at the
best of t = 0, t = inf and the thresholds offloading 25/50/75%, each local split) over axes:
``base`` (16 trace and log-normal workloads x Poisson and bursty arrivals), ``link`` (10-400
Gbps), ``mfu`` (the calibrated 20.8%); 200 requests a run, at least rate x 30 s. The paper's
conditions: prompt p50 >= 8K, link under 70% used. ``--quick``: 6 points, 150 requests.
"""

from __future__ import annotations

import time

from benchmarks.disagg_common import out_dir, pool, pyplot
from hyla.disagg.sim.capacity import compare_capacity
from hyla.disagg.sim.hardware import published_1t_hybrid
from hyla.disagg.sim.model import SimConfig
from hyla.disagg.sim.setups import published_deployments, workload_maker
from hyla.disagg.sim.workload import SyntheticMix, describe

# the earlier single-seed fit (disagg_sim); hyla simulate --fit-h200-mfu 1.16 over 5 seeds
# gives 21.25%, within one bisection step of it
CALIBRATED_MFU = 0.208
OUTPUTS = {"short": 16, "long": 512}
WORKLOADS = {w["name"]: w for w in
             [{"name": f"{tr} x{k}", "trace": tr, "scale": k}
              for tr in ("azure-conv", "arxiv-summarization") for k in (1, 4, 8, 16)]
             + [{"name": f"lognormal {m // 1024}K, {o} out", "median": m, "output": o}
                for m in (1024, 4096, 16_384, 65_536) for o in OUTPUTS]}
LONG = [f"lognormal {k}K, long out" for k in (4, 16, 64)]


def add_args(parser) -> None:
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds a point")
    parser.add_argument("--point", action="append", default=None, metavar="LABEL",
                        help="only this point (repeatable), e.g. 'link/lognormal 64K, long "
                             "out/poisson/10G'; into disagg_robust_points")


def point(axis, name, arrivals="poisson", link=100.0, mfu=0.45) -> dict:
    return {"axis": axis, **WORKLOADS[name], "arrivals": arrivals, "link": link, "mfu": mfu}


def grid(quick: bool) -> list[dict]:
    if quick:
        return [point("base", n) for n in ("azure-conv x1", "azure-conv x8",
                                           "lognormal 1K, short out", LONG[1])] + [
            point("link", LONG[1], link=10.0), point("mfu", "azure-conv x8", mfu=CALIBRATED_MFU)]
    return ([point("base", n, a) for n in WORKLOADS for a in ("poisson", "gamma")]
            + [point("link", n, link=g) for n in ["azure-conv x8", *LONG]
               for g in (10.0, 25.0, 50.0, 400.0)]
            + [point("mfu", n, mfu=CALIBRATED_MFU) for n in WORKLOADS])


def label(pt: dict) -> str:
    return f"{pt['axis']}/{pt['name']}/{pt['arrivals']}/{pt['link']:g}G"


def run_point(job: tuple) -> dict:
    pt, opts = job
    t0, kw = time.time(), {"arrivals": pt["arrivals"], "num_requests": opts["requests"],
                           "min_duration_s": opts["min_duration"]}
    if "trace" in pt:
        kw |= {"trace": pt["trace"], "length_scale": pt["scale"]}
    else:
        kw["mix"] = SyntheticMix(prompt_median=pt["median"], prompt_sigma=0.8, followup=0.0,
                                 output_median=OUTPUTS[pt["output"]], output_sigma=0.8)

    def make(seed):
        return workload_maker(seed=seed, **kw)
    res = compare_capacity(published_1t_hybrid(), published_deployments(remote_mfu=pt["mfu"]),
                           make, list(range(opts["seeds"])), SimConfig(link_gbps=pt["link"]),
                           fractions=(0.25, 0.5, 0.75), rel_tol=0.03, configured=False,
                           finalists=2)
    d, ratio = res["deployments"], res["ratios"]["prfaas_vs_best_baseline"]
    w, p0 = describe(make(0)(1.0)), d["prfaas"]["per_seed"][0]
    use = p0["metrics"].get("link_utilisation")
    return {**{k: pt[k] for k in ("axis", "name", "arrivals", "link", "mfu")},
            "prompt_p50": w["prompt_p50"], "output_p50": w["output_p50"],
            **{k: d[k]["capacity"]["mean"] for k in ("homogeneous", "naive", "prfaas")},
            **{f"ratio{k}": ratio[k[1:] or "mean"] for k in ("", "_lo", "_hi", "_half")},
            "vs_naive": res["ratios"]["prfaas_vs_naive"]["mean"],
            "vs_homogeneous": res["ratios"]["prfaas_vs_homogeneous"]["mean"],
            "choice": d["prfaas"]["choice"][0], "family": p0.get("family"),
            "homogeneous_split": d["homogeneous"]["choice"][0],
            "alternatives": {f: iv["mean"] for f, iv in d["prfaas"]["alternatives"].items()},
            "offload": p0["metrics"].get("offload_fraction"), "link_utilisation": use,
            "paper_conditions": w["prompt_p50"] >= 8192 and (use or 0.0) < 0.7,
            "wall_s": time.time() - t0, "detail": res}


def plot(path, rows) -> None:
    """A bar a point with its 95% interval, green in the paper's conditions."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.24 * len(rows)))
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], height=0.7, capsize=2,
            xerr=[[r["ratio"] - (r["ratio_lo"] or r["ratio"]) for r in rows],
                  [(r["ratio_hi"] or r["ratio"]) - r["ratio"] for r in rows]],
            color=["tab:green" if r["paper_conditions"] else "tab:blue" for r in rows])
    ax.axvline(0.97, color="red", lw=1, ls="--", label="0.97: the floor")
    ax.axvline(1.1, color="gray", lw=1, ls=":", label="1.1: the target (green: the paper's "
               "conditions, prompt p50 >= 8K, link < 70%)")
    ax.set_yticks(range(len(rows)), [
        f"{r['axis']}: {r['name']}{', bursty' * (r['arrivals'] == 'gamma')}"
        + {"link": f", {r['link']:g} Gbps", "mfu": f", MFU {r['mfu']:.1%}"}.get(r["axis"], "")
        for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0.8, max(1.3, 1.05 * max(r["ratio_hi"] or r["ratio"] for r in rows)))
    ax.set_xlabel("PrfaaS capacity / the better of naive heterogeneous and homogeneous PD")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(run) -> None:
    a = run.args
    opts = {"seeds": a.seeds, "requests": 150 if a.quick else 200, "min_duration": 30.0}
    pts, name = grid(a.quick), f"disagg_robust{'_quick' if a.quick else ''}"
    if a.point:
        known = {label(p): p for p in pts}
        if bad := [x for x in a.point if x not in known]:
            raise SystemExit(f"unknown --point {bad}; the grid's points: {sorted(known)}")
        pts, name = [known[x] for x in a.point], f"{name}_points"
    run.progress(f"{len(pts)} points, {opts}")
    rows = []
    with pool(a.jobs) as workers:
        for r in workers.imap_unordered(run_point, [(p, opts) for p in pts]):
            rows.append(r)
            run.progress(f"{label(r)} mfu {r['mfu']:.3f}: homo {r['homogeneous']:.3g} naive "
                         f"{r['naive']:.3g} prfaas {r['prfaas']:.3g} = {r['ratio']:.3f}x "
                         f"+- {r['ratio_half'] or 0:.3f} ({r['choice']})")
    order = [label(p) for p in pts]
    rows.sort(key=lambda r: order.index(label(r)))
    table = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
              if k not in ("detail", "alternatives", "ratio_lo", "ratio_hi", "wall_s")}
             for r in rows]
    run.table("PrfaaS vs the better baseline, capacity under SLOs", table)
    paper, ratios = [r for r in rows if r["paper_conditions"]], sorted(r["ratio"] for r in rows)
    found = {"points": len(rows), "seeds": a.seeds, "min_ratio": ratios[0],
             "min_at": label(min(rows, key=lambda r: r["ratio"])),
             "below_0_97": sum(r < 0.97 for r in ratios),
             "below_0_97_whole_interval": sum((r["ratio_hi"] or r["ratio"]) < 0.97 for r in rows),
             "paper_points": len(paper), "paper_below_1_1": sum(r["ratio"] < 1.1 for r in paper),
             "paper_min_ratio": min((r["ratio"] for r in paper), default=float("nan"))}
    plot(png := out_dir(run) / f"{name}.png", rows)
    run.save(table, name=name, findings=found, options=opts, points=rows, png=png.name,
             note="simulated, not measured",
             summary=f"PrfaaS / best baseline {ratios[0]:.2f}x-{ratios[-1]:.2f}x over "
                     f"{len(rows)} points, median {ratios[len(ratios) // 2]:.2f}x, "
                     f"{found['below_0_97']} below 0.97x; in the paper's conditions "
                     f"({len(paper)} points) from {found['paper_min_ratio']:.2f}x")
