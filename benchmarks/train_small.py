"""Claim under test: Muon reaches AdamW's loss in fewer steps (and says what it costs in time).

Trains the same preset on the embedded stdlib corpus twice, from the same initialisation and
data order, once with Muon (+ AdamW for embeddings, head, norms, biases) and once with AdamW
alone, and records validation loss against steps and against wall-clock time. The two views
differ on a CPU: Newton-Schulz is a fixed cost per step that a small batch does not amortise.

    python benchmarks/train_small.py                    # small, 60 steps of 1,024 tokens
    python benchmarks/train_small.py --steps 10 --quick # a smoke run

Writes ``benchmarks/results/train_small.json`` and ``train_small.png``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from hyla.perf import print_table, tune_cpu_allocator, write_results
from hyla.train.config import TrainConfig
from hyla.train.trainer import Trainer

LEARNING_RATES = {"muon": {"muon_lr": 0.02, "lr": 3e-3}, "adamw": {"lr": 3e-3}}


def run(optimizer: str, args, out: pathlib.Path) -> list[dict]:
    cfg = TrainConfig(preset=args.preset, steps=args.steps, seq_len=args.seq_len,
                      batch_size=args.batch_size, optimizer=optimizer, warmup_steps=5,
                      eval_every=args.eval_every, eval_batches=args.eval_batches,
                      save_every=args.steps, out=str(out / optimizer), seed=0,
                      **LEARNING_RATES[optimizer])
    trainer = Trainer(cfg)
    start = time.perf_counter()
    trainer.fit(progress=True)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / optimizer / "metrics.jsonl").open()]
    elapsed = 0.0
    for r in records:  # wall time from the per-step throughput the trainer logged
        elapsed += cfg.tokens_per_step / r["tokens_per_s"]
        r["train_seconds"] = elapsed
    records[-1]["wall_seconds"] = wall
    return records


def plot(curves: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in curves.items():
        val = [r for r in records if "val_loss" in r]
        axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label=name)
        axes[1].plot([r["train_seconds"] for r in val], [r["val_loss"] for r in val], "o-",
                     label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (this machine)")
    for ax in axes:
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Muon vs AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="write *_quick results")
    args = parser.parse_args()
    tune_cpu_allocator()
    name = "train_small_quick" if args.quick else "train_small"
    with tempfile.TemporaryDirectory() as tmp:
        curves = {opt: run(opt, args, pathlib.Path(tmp)) for opt in ("muon", "adamw")}
    rows = []
    # Short runs on few files are noisy and not monotone: compare against AdamW's best.
    adamw_best = min(r["val_loss"] for r in curves["adamw"] if "val_loss" in r)
    for opt, records in curves.items():
        val = [r for r in records if "val_loss" in r]
        reach = next((r for r in val if r["val_loss"] <= adamw_best), None)
        rows.append({"optimizer": opt, "final_val_loss": val[-1]["val_loss"],
                     "best_val_loss": min(r["val_loss"] for r in val),
                     "steps_to_adamw_best": reach and reach["step"],
                     "seconds_to_adamw_best": reach and reach["train_seconds"],
                     "train_seconds": records[-1]["train_seconds"],
                     "sec_per_step": records[-1]["train_seconds"] / len(records)})
    print_table(f"{args.preset}: Muon vs AdamW, {args.steps} steps of "
                f"{args.seq_len * args.batch_size:,} tokens", rows)
    results = pathlib.Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    plot(curves, results / f"{name}.png")
    path = write_results(name, rows, curves=curves, settings=vars(args))
    print(f"wrote {path} and {results / (name + '.png')}")


if __name__ == "__main__":
    main()
