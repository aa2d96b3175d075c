"""Claim under test: mixing training data at the block level (a shuffle buffer over many
documents) gives a falling loss curve and a lower validation loss than file-level shuffling
alone, at the quickstart's budget.

Trains the quickstart's model and schedule (``small``, AdamW, 120 steps of 4 x 256 tokens on
the stdlib corpus) from the same initialisation and tokenizer, once reading the shuffled files
block after block (``shuffle_buffer=0``, the packer before the buffer) and once through the
block shuffle buffer, and evaluates both every ``--eval-every`` steps on a broad validation
set: 64 blocks drawn from across the stdlib validation split (the quickstart's own validation
figure, ``eval_batches`` blocks from the first validation files, is reported too). More
variants (``--variant name:key=value,...``, TrainConfig fields) try other quickstart defaults.

    python benchmarks/data_mixing.py --parallel          # file vs block mixing, side by side
    python benchmarks/data_mixing.py --parallel --name data_mixing_sweep \
        --variant lr5e-3:lr=5e-3 --variant seq128x8:seq_len=128,batch_size=8 \
        --variant lr2e-3:lr=2e-3                         # the quickstart's defaults
    python benchmarks/data_mixing.py --steps 4 --quick   # a smoke run

Writes ``benchmarks/results/<name>.json`` and ``<name>.png`` (name: data_mixing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tempfile
import time

import torch

from hyla.perf import print_table, tune_cpu_allocator, write_results
from hyla.train.batches import next_batch
from hyla.train.config import TrainConfig, quickstart_config
from hyla.train.objectives import lm_loss, validation_loss
from hyla.train.trainer import Trainer

# At lr 3e-3, the quickstart's rate when this was measured (results/data_mixing.json); the
# sweep below then moved the quickstart to 2e-3 (results/data_mixing_sweep.json).
VARIANTS = {"file-level": {"shuffle_buffer": 0, "lr": 3e-3},
            "block-level": {"shuffle_buffer": 1024, "lr": 3e-3}}


def broad_batches(tokenizer, seq_len: int, blocks: int) -> list:
    """``blocks`` validation blocks from across the split (a buffer over most of it), in
    batches of 4: the same for every run."""
    from hyla.data.packing import corpus_blocks

    stream = corpus_blocks(None, tokenizer, seq_len, split="validation", seed=0,
                           shuffle_buffer=2048)
    return [next_batch(stream, 4) for _ in range(blocks // 4)]


@torch.no_grad()
def broad_loss(model, batches) -> float:
    was = model.training
    model.eval()
    loss = sum(lm_loss(model, *b).item() for b in batches) / len(batches)
    model.train(was)
    return loss


def run(name: str, changes: dict, args, out: pathlib.Path) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = quickstart_config(steps=args.steps, out=str(out / name), eval_every=args.eval_every,
                            **changes)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    # the same 256-token blocks whatever the run's seq_len, so variants compare
    batches = broad_batches(trainer.tokenizer, args.val_seq_len, args.val_blocks)
    trainer.loop.validate = lambda: broad_loss(trainer.model, batches)
    trainer.fit(progress=not args.no_progress)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").open()]
    elapsed = 0.0
    for r in records:  # training seconds from the per-step throughput the loop logged
        elapsed += cfg.tokens_per_step / r["tokens_per_s"]
        r["train_seconds"] = elapsed
    records[-1]["quickstart_val_loss"] = validation_loss(trainer.model, trainer.tokenizer, cfg)
    records[-1]["wall_seconds"] = wall
    return records


def plot(curves: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, records in curves.items():
        line, = axes[0].plot([r["step"] for r in records], [r["loss"] for r in records],
                             lw=0.9, alpha=0.8, label=f"{name}: training batches")
        val = [r for r in records if "val_loss" in r]
        axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--",
                     color=line.get_color(), label=f"{name}: validation")
        axes[1].plot([r["train_seconds"] for r in val], [r["val_loss"] for r in val], "o-",
                     color=line.get_color(), label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (this machine, shared)")
    for ax in axes:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    changes = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--variant: {key!r} is not a TrainConfig field")
        kind = type(getattr(TrainConfig(), key))
        changes[key] = kind(float(value)) if kind is int else kind(value)
    return name, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--val-blocks", type=int, default=64)
    parser.add_argument("--val-seq-len", type=int, default=256)
    parser.add_argument("--variant", action="append", default=[],
                        help="name:field=value,... (replaces the default pair)")
    parser.add_argument("--name", default=None, help="results name (default data_mixing)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads a run (default: torch's; 1 with --parallel)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the variants at once, one process each: side by side under "
                             "the same machine load (a shared machine's load swings)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--quick", action="store_true", help="write *_quick results")
    args = parser.parse_args()
    tune_cpu_allocator()
    if args.parallel and not args.threads:
        args.threads = 1
    variants = dict(map(parse_variant, args.variant)) if args.variant else VARIANTS
    name = args.name or ("data_mixing_quick" if args.quick else "data_mixing")
    with tempfile.TemporaryDirectory() as tmp:
        if args.parallel:
            from concurrent.futures import ProcessPoolExecutor
            from multiprocessing import get_context

            with ProcessPoolExecutor(len(variants), mp_context=get_context("spawn")) as pool:
                jobs = {v: pool.submit(run, v, changes, args, pathlib.Path(tmp))
                        for v, changes in variants.items()}
                curves = {v: job.result() for v, job in jobs.items()}
        else:
            curves = {v: run(v, changes, args, pathlib.Path(tmp))
                      for v, changes in variants.items()}
    rows = []
    for v, records in curves.items():
        val = [r for r in records if "val_loss" in r]
        losses = [r["loss"] for r in records]
        tail = losses[len(losses) * 2 // 3:]
        rows.append({"variant": v, **variants[v], "final_val_loss": val[-1]["val_loss"],
                     "quickstart_val_loss": records[-1]["quickstart_val_loss"],
                     "train_loss_last_third_mean": sum(tail) / len(tail),
                     "train_loss_last_third_max": max(tail),
                     "train_seconds": records[-1]["train_seconds"],
                     "wall_seconds": records[-1]["wall_seconds"]})
    title = (f"small, {args.steps} AdamW steps of 1,024 tokens (the quickstart): "
             f"validation on {args.val_blocks} blocks across the validation split")
    print_table(title, rows)
    results = pathlib.Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    plot(curves, results / f"{name}.png", title)
    path = write_results(name, rows, curves=curves, settings=vars(args))
    print(f"wrote {path} and {results / (name + '.png')}")


if __name__ == "__main__":
    main()
