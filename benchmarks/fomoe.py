"""Claim under test (issue 28, FoMoE): at ``--sync-every 16`` FoMoE sends >= 1.4x fewer bytes
than DiLoCo and >= 20x fewer than FSDP, its validation loss stays within 10% of FSDP's at equal
tokens, and token skipping gives >= 1.2x DiLoCo's tokens/s at R = 1.

Runs ``torchrun --nproc-per-node W -m hyla train --strategy S`` (gloo, CPU) for W = 2 and 4,
the same per-rank batch, steps and data for every strategy at a W (so equal tokens):

- ``fsdp``: per-step reduce-scatter + all-gather (the FSDP2 default);
- ``diloco``: full replicas, outer Nesterov every ``--sync-every`` steps;
- ``fomoe`` R = 1 with token skipping, R = 1 without, and R = W/2 (W = 4 only: at W = 2,
  R = W/2 is R = 1).

Figures a run, read from its ``metrics.jsonl`` and ``run.json``:

- ``comm B/token``: the sum over steps of ``comm_bytes`` (the busiest rank's bytes a step)
  divided by the global tokens of the run;
- ``val loss``: the run's final ``val_loss`` (same tokens for every strategy at a W);
- ``tokens/s``: global tokens over the summed step times after the first step (sync steps
  included), the median over ``--repeats`` runs; ``median step tokens/s`` beside it.

On the 2-core machine this was written on, W = 4 runs 4 ranks on 2 cores (oversubscribed 2x):
its tokens/s measure contention as much as the strategies. One OpenMP thread a rank.

    python benchmarks/fomoe.py                          # small-moe, W = 2 4, 32 steps
    python benchmarks/fomoe.py --preset debug-moe --worlds 2 --steps 8 --sync-every 4
    python benchmarks/fomoe.py --worlds 2 --outer-lr 1 --outer-momentum 0 --name fomoe_avg

Writes ``benchmarks/results/fomoe.json`` (rewritten after every run, so a cut-short run
leaves what it measured) and ``fomoe.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hyla.perf import print_table, write_results

TARGETS = {"comm_vs_diloco": 1.4, "comm_vs_fsdp": 20.0, "val_loss_rel": 0.10,
           "skip_tokens_per_s_vs_diloco": 1.2}


def variants(world: int) -> list[tuple[str, list[str]]]:
    """(label, extra ``hyla train`` flags) of every strategy run at ``world`` ranks."""
    out = [("fsdp", ["--strategy", "fsdp"]),
           ("diloco", ["--strategy", "diloco"]),
           ("fomoe R=1 skip", ["--strategy", "fomoe", "--expert-replicas", "1",
                               "--token-skipping"]),
           ("fomoe R=1 no-skip", ["--strategy", "fomoe", "--expert-replicas", "1",
                                  "--no-token-skipping"])]
    if world // 2 > 1:
        out.append((f"fomoe R={world // 2} skip",
                    ["--strategy", "fomoe", "--expert-replicas", str(world // 2),
                     "--token-skipping"]))
    return out


def run_one(world: int, label: str, flags: list[str], args, tmp: pathlib.Path,
            attempt: int) -> dict:
    out = tmp / f"w{world}-{label.replace(' ', '_').replace('=', '')}-{attempt}"
    out.mkdir(parents=True)
    shutil.copy(tmp / "tokenizer.json", out / "tokenizer.json")
    torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(world), "-m", "hyla", "train",
           "--preset", args.preset, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--optimizer", args.optimizer,
           "--sync-every", str(args.sync_every), "--out", str(out),
           "--save-every", str(args.steps), "--eval-batches", str(args.eval_batches),
           "--seed", str(args.seed), "--no-progress", *flags]
    if label != "fsdp":
        for flag, value in (("--outer-lr", args.outer_lr),
                            ("--outer-momentum", args.outer_momentum)):
            if value is not None:
                cmd += [flag, str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"world": world, "label": label, "attempt": attempt, "error": "timeout"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        log = proc.stderr or proc.stdout
        return {"world": world, "label": label, "attempt": attempt, "wall_s": wall,
                "error": log[-3000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in records if "tokens_per_s" in r]
    parallel = json.loads((out / "run.json").read_text()).get("parallel", {})
    tokens = steps[-1]["tokens"]
    step_tokens = tokens / len(steps)
    later = steps[1:] or steps
    seconds = sum(step_tokens / r["tokens_per_s"] for r in later)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    changed = [r["routing_changed"] for r in steps if "routing_changed" in r]
    comm = sum(r.get("comm_bytes", 0) for r in steps)
    return {"world": world, "label": label, "attempt": attempt, "wall_s": wall,
            "tokens": tokens, "comm_bytes_total": comm, "comm_bytes_per_token": comm / tokens,
            "tokens_per_s": step_tokens * len(later) / seconds,
            "median_step_tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "val_loss": val[-1] if val else None, "final_train_loss": steps[-1]["loss"],
            "routing_changed_last": changed[-1] if changed else None,
            "expert_load_entropy_last": steps[-1].get("expert_load_entropy"),
            "parallel": {k: v for k, v in parallel.items() if k != "mesh"}}


def summarise(runs: list[dict]) -> tuple[list[dict], dict]:
    """One row per (W, strategy) (median over repeats) and the targets at every W."""
    rows, checks = [], {}
    keys = []
    for r in runs:
        if (r["world"], r["label"]) not in keys:
            keys.append((r["world"], r["label"]))
    by = {}
    for world, label in keys:
        ok = [r for r in runs if r["world"] == world and r["label"] == label
              and "error" not in r]
        if not ok:
            rows.append({"W": world, "strategy": label, "status": "failed"})
            continue
        p = ok[0]["parallel"]
        row = {"W": world, "strategy": label,
               "comm B/token": statistics.median(r["comm_bytes_per_token"] for r in ok),
               "val loss": statistics.median(r["val_loss"] for r in ok),
               "tokens/s": statistics.median(r["tokens_per_s"] for r in ok),
               "median step tokens/s": statistics.median(r["median_step_tokens_per_s"]
                                                         for r in ok),
               "params MB/rank": max(p.get("param_bytes_local") or [0]) / 1e6,
               "params MB total": (p.get("param_bytes_total") or 0) / 1e6,
               "repeats": len(ok)}
        rows.append(row)
        by[(world, label)] = row
    for world in sorted({w for w, _ in keys}):
        f, d, s = (by.get((world, k)) for k in ("fsdp", "diloco", "fomoe R=1 skip"))
        ns = by.get((world, "fomoe R=1 no-skip"))
        c = {}
        if d and s:
            c["comm_vs_diloco"] = d["comm B/token"] / s["comm B/token"]
            c["skip_tokens_per_s_vs_diloco"] = s["tokens/s"] / d["tokens/s"]
        if f and s:
            c["comm_vs_fsdp"] = f["comm B/token"] / s["comm B/token"]
            c["val_loss_rel"] = s["val loss"] / f["val loss"] - 1
        if f and d:
            c["diloco_comm_vs_fsdp"] = f["comm B/token"] / d["comm B/token"]
            c["diloco_val_loss_rel"] = d["val loss"] / f["val loss"] - 1
        if s and ns:
            c["skip_tokens_per_s_vs_no_skip"] = s["tokens/s"] / ns["tokens/s"]
        met = {}
        for k, target in TARGETS.items():
            if k in c:
                met[k] = abs(c[k]) <= target if k == "val_loss_rel" else c[k] >= target
        checks[f"W={world}"] = {"ratios": c, "met": met}
    return rows, checks


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Bars a W: comm B/token (log scale), val loss, tokens/s, one bar a strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "status" not in r]
    worlds = sorted({r["W"] for r in ok})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, ("comm B/token", "val loss", "tokens/s"), strict=True):
        labels = list(dict.fromkeys(r["strategy"] for r in ok))
        width = 0.8 / max(len(worlds), 1)
        for j, world in enumerate(worlds):
            by = {r["strategy"]: r[key] for r in ok if r["W"] == world}
            xs = [i + j * width for i, lab in enumerate(labels) if lab in by]
            ax.bar(xs, [by[lab] for lab in labels if lab in by], width, label=f"W={world}")
        ax.set_xticks([i + width * (len(worlds) - 1) / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(key)
        if key == "comm B/token":
            ax.set_yscale("log")
        if key == "val loss":
            ax.set_ylim(min(r[key] for r in ok) - 0.5, max(r[key] for r in ok) + 0.2)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-moe")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences a rank a step")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--outer-lr", type=float, default=None, help="default: hyla's (0.7)")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="default: hyla's (0.9, Nesterov)")
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only these strategy labels (e.g. diloco 'fomoe R=1 skip')")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run")
    ap.add_argument("--name", default="fomoe", help="results file stem")
    args = ap.parse_args()
    if min(args.worlds) < 2 or args.steps < 2 or args.sync_every < 1 or args.repeats < 1:
        ap.error("--worlds >= 2, --steps >= 2, --sync-every >= 1, --repeats >= 1")
    versions = {p: importlib.metadata.version(p) for p in ("torch",)}
    versions["python"] = sys.version.split()[0]
    settings = {k: v for k, v in vars(args).items() if k != "name"}
    settings["threads_per_rank"] = 1
    settings["oversubscribed"] = {w: w > (os.cpu_count() or 1) for w in args.worlds}
    runs: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name:
        tmp = pathlib.Path(name)
        subprocess.run([sys.executable, "-m", "hyla", "tokenizer", "train", "--documents",
                        "400", "--out", str(tmp)], check=True, capture_output=True)
        for i in range(args.repeats):
            for world in args.worlds:
                todo = [v for v in variants(world) if args.only is None or v[0] in args.only]
                for label, flags in (todo if i % 2 == 0 else todo[::-1]):
                    run = run_one(world, label, flags, args, tmp, i)
                    runs.append(run)
                    if "error" in run:
                        print(f"W={world} {label} failed:\n{run['error']}", file=sys.stderr)
                    else:
                        print(f"W={world} {label}: {run['comm_bytes_per_token']:.0f} B/token, "
                              f"val {run['val_loss']:.4f}, {run['tokens_per_s']:.0f} tok/s, "
                              f"{run['wall_s']:.0f} s", flush=True)
                    rows, checks = summarise(runs)
                    write_results(args.name, rows, versions=versions, settings=settings,
                                  targets=TARGETS, checks=checks, runs=runs,
                                  wall_s=time.perf_counter() - started)
    rows, checks = summarise(runs)
    print_table(f"FoMoE vs DiLoCo vs FSDP ({args.preset}, {args.steps} steps, "
                f"H = {args.sync_every})", rows)
    for world, c in checks.items():
        print(world, json.dumps(c, indent=None))
    try:
        path = pathlib.Path(__file__).resolve().parent / "results" / f"{args.name}.png"
        plot(rows, path)
        print("wrote", path)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
