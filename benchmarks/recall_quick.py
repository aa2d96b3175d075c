"""The MQAR recall sweep of ``hyla eval recall --preset quick``, one process a mixer.

Each mixer trains in its own process (one torch thread), so a shared machine finishes the
sweep sooner; the records are the ones the sequential CLI writes (each training seeds torch
itself and draws its batches from the seed and the step alone). Reports the wall time and
each training's CPU seconds: their sum is the sweep's time on an idle machine with one
thread, which is what ``hyla eval recall --preset quick`` takes.

    python benchmarks/recall_quick.py                       # -> benchmarks/results/recall_quick/
    python benchmarks/recall_quick.py --mixers GG,AA --steps 200 --out /tmp/r

Writes ``results.json`` (every record), ``run.json`` (preset, times, machine) and the two
figures (accuracy against pairs with each model's state beside its curve, and against state
bytes).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hyla.eval.recall.plots import plot_recall, write_recall  # noqa: E402
from hyla.eval.recall.synthetic import best_records, recall_preset, run_recall  # noqa: E402
from hyla.perf import machine_info  # noqa: E402


def one_mixer(preset, seed: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    return run_recall(preset, seed=seed, progress=lambda line: print(line, flush=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="quick", help="recall preset (default: %(default)s)")
    ap.add_argument("--mixers", default=None,
                    help="comma-separated layer strings (default: the preset's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes at once (default: one a mixer)")
    ap.add_argument("--out", type=pathlib.Path,
                    default=ROOT / "benchmarks" / "results" / "recall_quick",
                    help="results folder (default: %(default)s)")
    args = ap.parse_args()
    p = recall_preset(args.preset)
    if args.mixers:
        p = dataclasses.replace(p, mixers=tuple(args.mixers.split(",")))
    if args.steps:
        p = dataclasses.replace(p, train_steps=args.steps)
    start = time.perf_counter()
    jobs = args.jobs or len(p.mixers)
    with cf.ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(one_mixer, dataclasses.replace(p, mixers=(m,)), args.seed)
                   for m in p.mixers]
        records = [r for f in futures for r in f.result()]
    wall = time.perf_counter() - start
    trainings = {(r["mixer"], r["lr"]): r["train_cpu_seconds"] for r in records}
    cpu = sum(trainings.values())
    best = best_records(records)
    write_recall(records, args.out, preset=dataclasses.asdict(p), seed=args.seed,
                 seconds=round(wall, 1), cpu_seconds=round(cpu, 1), processes=jobs,
                 note="one process a mixer, one thread each; cpu_seconds: the sum over "
                      "trainings, the sequential CLI's time on an idle machine",
                 machine=machine_info())
    plot_recall(best, args.out, title=f"MQAR ({p.name}), seed {args.seed}")
    pairs = sorted({r["num_kv_pairs"] for r in best})
    print(f"\n{'mixer':<6} {'state':>10} " + " ".join(f"{q:>5}" for q in pairs)
          + "  cpu s")
    for m in p.mixers:
        rows = sorted((r for r in best if r["mixer"] == m), key=lambda r: r["num_kv_pairs"])
        state = rows[-1]["state_bytes"]
        print(f"{m:<6} {state:>10,} " + " ".join(f"{r['accuracy']:5.2f}" for r in rows)
              + f"  {rows[0]['train_cpu_seconds']:5.0f}")
    print(f"wall {wall:.0f} s with {jobs} processes; CPU {cpu:.0f} s "
          f"(the sequential sweep on an idle core)")
    print(json.dumps({"wall_s": round(wall), "cpu_s": round(cpu)}))


if __name__ == "__main__":
    main()
