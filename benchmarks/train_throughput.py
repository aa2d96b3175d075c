"""Claim under test: what a training step costs with Muon (both strategies) and AdamW, W = 1, 2.

Runs ``hyla train`` (under ``torchrun --nproc-per-node W`` for W > 1) for a few steps of the
same preset and per-rank batch, and reports the median tokens/s of the steps after the first
(global tokens: W ranks x batch). On one 2-core machine, W = 2 shares the same two cores, so
this measures overheads (communication, Newton-Schulz work per rank), not scaling.

    python benchmarks/train_throughput.py                 # small, 6 steps each
    python benchmarks/train_throughput.py --preset debug  # seconds

Writes ``benchmarks/results/train_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

from hyla.perf import print_table, write_results

CASES = [(1, "adamw", None), (1, "muon", None), (2, "adamw", None),
         (2, "muon", "all_gather"), (2, "muon", "all_to_all")]


def run_case(world: int, optimizer: str, strategy: str | None, args, tmp: pathlib.Path) -> dict:
    out = tmp / f"w{world}-{optimizer}-{strategy}"
    train = ["train", "--preset", args.preset, "--steps", str(args.steps), "--seq-len",
             str(args.seq_len), "--batch-size", str(args.batch_size), "--optimizer", optimizer,
             "--out", str(out), "--save-every", str(args.steps), "--eval-batches", "1",
             "--no-progress"]
    if strategy:
        train += ["--muon-strategy", strategy]
    if world == 1:
        cmd = [sys.executable, "-m", "hyla.cli", *train]
    else:
        torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).parent /
                                                   "torchrun")
        cmd = [torchrun, "--nproc-per-node", str(world), "-m", "hyla.cli", *train]
    if out.exists():
        shutil.rmtree(out)
    # the tokenizer is trained once and shared, so every case reads the same tokens
    out.mkdir(parents=True)
    shutil.copy(tmp / "tokenizer.json", out / "tokenizer.json")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    rates = [r["tokens_per_s"] for r in records[1:]]
    return {"world": world, "optimizer": optimizer, "muon_strategy": strategy or "-",
            "tokens_per_s": statistics.median(rates), "steps_timed": len(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = pathlib.Path(name)
        subprocess.run([sys.executable, "-m", "hyla.cli", "tokenizer", "train", "--documents",
                        "400", "--out", str(tmp)], check=True, capture_output=True)
        rows = [run_case(w, o, s, args, tmp) for w, o, s in CASES]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_w1_adamw"] = r["tokens_per_s"] / base
    print_table(f"training step throughput, {args.preset}, {args.seq_len * args.batch_size:,} "
                "tokens per rank per step (2 cores shared by all ranks)", rows)
    print(f"wrote {write_results('train_throughput', rows, settings=vars(args))}")


if __name__ == "__main__":
    main()
