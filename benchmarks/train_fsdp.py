"""Claim under test: FSDP2 training (``--strategy fsdp``) at W = 1, 2, 4 ranks on CPU (gloo):
tokens/s, what each rank holds and what it sends, beside the plan of ``hyla memory --train``.

Runs ``hyla train --preset small`` for a few steps at each world size (``torchrun
--nproc-per-node W -m hyla train --strategy fsdp`` for W > 1; one plain process at W = 1),
the same per-rank batch each time (so the global batch grows with W), and reads back:

- ``tokens_per_s``: median over the steps after the first (global tokens: W x batch);
- per rank, from the run's ``run.json`` ``parallel`` section: ``param_bytes_local``,
  ``optimizer_bytes`` and ``peak_memory_bytes`` (peak RSS on CPU: the whole process, torch
  and Python included), the busiest rank's figure in the table;
- ``comm_bytes`` from ``metrics.jsonl``: the most any rank sent in a step (median of steps);
- ``planned``: parameter, optimizer and total bytes a rank and the bytes sent a step by
  :func:`hyla.eval.train_memory.train_memory_report` (fsdp), beside the measured.

Every rank runs ``--threads-per-rank`` CPU threads (default 1: on a shared, loaded machine
two OpenMP threads of one process wait on each other's barriers: W = 1 with two threads
ran 6.7x slower than with one, measured here). On a 2-core machine W = 4 runs 4 ranks on 2 cores,
oversubscribed 2x: the tokens/s then measure overheads, not scaling. With Muon a rank's
tokens/s can grow with W: Newton-Schulz (about 134 GFLOP a step for ``small``, twice the
model's forward and backward at 512 tokens) is split among the matrices' owner ranks, so
AdamW runs beside it show FSDP's own cost. On a GPU machine the same script is the first
check.

    python benchmarks/train_fsdp.py                     # small, W = 1 2 4, muon + adamw
    python benchmarks/train_fsdp.py --worlds 1 2 --steps 3 --seq-len 64

Writes ``benchmarks/results/train_fsdp.json``.
"""

from __future__ import annotations

import argparse
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


def _command(world: int, train: list[str]) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "hyla", *train]
    torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(world), "-m", "hyla", *train]


def run_world(world: int, optimizer: str, args, tmp: pathlib.Path, attempt: int = 0) -> dict:
    """Train at ``world`` ranks in ``tmp/<optimizer>-w<world>-<attempt>``; the figures and
    the raw records."""
    out = tmp / f"{optimizer}-w{world}-{attempt}"
    out.mkdir(parents=True)
    shutil.copy(tmp / "tokenizer.json", out / "tokenizer.json")  # same tokens every run
    train = ["train", "--preset", args.preset, "--steps", str(args.steps), "--seq-len",
             str(args.seq_len), "--batch-size", str(args.batch_size), "--optimizer",
             optimizer, "--out", str(out), "--save-every", str(args.steps),
             "--eval-batches", "1", "--no-progress"]
    if world > 1:
        train += ["--strategy", args.strategy]
    threads = args.threads_per_rank
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(_command(world, train), capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        log = proc.stderr or proc.stdout
        causes = [line for line in log.splitlines()
                  if any(w in line for w in ("Error", "error:", "terminate", "what()"))]
        return {"world": world, "optimizer": optimizer, "attempt": attempt,
                "error": "\n".join(causes[-20:]), "log_tail": log[-6000:], "wall_s": wall}
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()
               if '"tokens_per_s"' in line]
    parallel = json.loads((out / "run.json").read_text()).get("parallel", {})
    later = records[1:] or records
    comm = [r.get("comm_bytes", 0) for r in later]
    return {"world": world, "optimizer": optimizer, "attempt": attempt,
            "threads_per_rank": threads, "wall_s": wall,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "steps_timed": len(later), "comm_bytes_step": statistics.median(comm),
            "parallel": parallel, "metrics": records}


def _row(run: dict, planned: dict) -> dict:
    if "error" in run:
        return {"optimizer": run["optimizer"], "W": run["world"], "status": "failed"}
    p = run["parallel"]

    def most(key):
        return max(p.get(key) or [0])

    return {"optimizer": run["optimizer"], "W": run["world"],
            "strategy": p.get("strategy", "-"), "tokens/s": run["tokens_per_s"],
            "params MB/rank": most("param_bytes_local") / 1e6,
            "planned params MB": planned["params"] / 1e6,
            "optim MB/rank": most("optimizer_bytes") / 1e6,
            "planned optim MB": planned["optimizer"] / 1e6,
            "peak RSS MB/rank": most("peak_memory_bytes") / 1e6,
            "planned total MB": planned["total"] / 1e6,
            "comm MB/step": run["comm_bytes_step"] / 1e6,
            "planned comm MB": planned["comm_bytes"] / 1e6, "wall s": run["wall_s"]}


def main() -> None:
    from hyla.eval.train_memory import train_memory_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences a rank a step")
    ap.add_argument("--optimizers", nargs="+", default=["muon", "adamw"],
                    choices=("muon", "adamw"))
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs a world size, in alternating order (1 2 4 4 2 1): the fastest "
                         "counts, so load from other processes biases no W")
    ap.add_argument("--threads-per-rank", type=int, default=1, help="OMP_NUM_THREADS a rank")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run")
    args = ap.parse_args()
    if any(w < 1 for w in args.worlds) or min(args.steps - 1, args.repeats,
                                               args.threads_per_rank) < 1:
        ap.error("--worlds must be >= 1, --steps >= 2 (the first step is not timed), "
                 "--repeats and --threads-per-rank >= 1")
    runs, rows = [], []
    with tempfile.TemporaryDirectory() as name:
        tmp = pathlib.Path(name)
        subprocess.run([sys.executable, "-m", "hyla", "tokenizer", "train", "--documents",
                        "400", "--out", str(tmp)], check=True, capture_output=True)
        order = [(o, w) for i in range(args.repeats)
                 for w in (args.worlds if i % 2 == 0 else args.worlds[::-1])
                 for o in args.optimizers]
        for i, (optimizer, world) in enumerate(order):
            run = run_world(world, optimizer, args, tmp, attempt=i)
            plan = train_memory_report(args.preset, world_size=world, seq_len=args.seq_len,
                                       batch_size=args.batch_size, optimizer=optimizer)
            run["planned"] = plan["strategies"]["fsdp" if world > 1 else "replicate"]
            runs.append(run)
            if "error" in run:
                print(f"{optimizer} W={world} failed:\n{run['error']}", file=sys.stderr)
    for optimizer in args.optimizers:
        base = None
        for world in args.worlds:
            mine = [r for r in runs if (r["optimizer"], r["world"]) == (optimizer, world)]
            done = [r for r in mine if "error" not in r]
            best = max(done, key=lambda r: r["tokens_per_s"]) if done else mine[0]
            row = {**_row(best, best["planned"]), "runs ok": f"{len(done)}/{len(mine)}"}
            if "tokens/s" in row:
                base = base or (row["tokens/s"] if world == 1 else None)
                row["vs W=1"] = row["tokens/s"] / base if base else ""
            rows.append(row)
    cores = os.cpu_count() or 1
    print_table(f"FSDP training, {args.preset}, {args.batch_size} x {args.seq_len} tokens a rank "
                f"a step, {args.threads_per_rank} thread(s) a rank ({cores} cores shared by "
                f"all ranks and other processes)", rows)
    note = ("same per-rank batch at every W (the global batch grows with W); peak RSS is the "
            "whole process (torch, Python, data) not only the model; comm = the most any rank "
            "sent in a step (median); planned = hyla memory --train (fp32; its total adds "
            "gradients, the all-gathered blocks and activations); tokens/s = the fastest of "
            f"--repeats runs; {cores} cores: W > {cores} is oversubscribed")
    path = write_results("train_fsdp", rows, settings=vars(args), runs=runs, note=note)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
