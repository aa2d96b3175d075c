"""Block-level data mixing beats file-level order at the quickstart's budget.

The quickstart (``small``, AdamW 3e-3, 120 steps of 4 x 256 tokens), same start, reading files
block after block or through a 1,024-block buffer; validation every 20 steps on 64 blocks from
across the stdlib validation split. ``--variant name:field=value,...`` replaces the pair (the
quickstart's defaults: ``--name data_mixing_sweep``). ``--quick``: ``debug``, 4 steps.
"""

import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from benchmarks.train_common import curve, out_dir, plot_curves, stem
from hyla.train.batches import next_batch
from hyla.train.config import TrainConfig, quickstart_config
from hyla.train.objectives import lm_loss, validation_loss
from hyla.train.trainer import Trainer

VARIANTS = {"file-level": {"shuffle_buffer": 0, "lr": 3e-3},
            "block-level": {"shuffle_buffer": 1024, "lr": 3e-3}}


def add_args(parser) -> None:
    parser.add_argument("--variant", action="append", default=[],
                        help="name:field=value,... (TrainConfig fields; replaces the pair)")
    parser.add_argument("--name", default="data_mixing", help="results name")
    parser.add_argument("--parallel", action="store_true", help="the variants at once, one "
                        "process and one thread each, under the same machine load")


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    changes = dict(item.partition("=")[::2] for item in filter(None, spec.split(",")))
    kinds = {k: type(getattr(TrainConfig(), k)) for k in changes}   # an unknown field raises
    return name, {k: kinds[k](float(v)) if kinds[k] is int else kinds[k](v)
                  for k, v in changes.items()}


@torch.no_grad()
def broad_loss(model, batches) -> float:
    model.eval()
    loss = sum(lm_loss(model, *b).item() for b in batches) / len(batches)
    model.train()
    return loss


def train(name: str, changes: dict, s: dict, out: str) -> list[dict]:
    from hyla.data.packing import corpus_blocks
    from hyla.perf import tune_cpu_allocator

    tune_cpu_allocator()        # a spawned process: as the harness does in its own
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    cfg = quickstart_config(preset=s["preset"], steps=s["steps"], out=f"{out}/{name}",
                            eval_every=s["eval_every"], **changes)
    start, trainer = time.perf_counter(), Trainer(cfg)
    # the same 256-token blocks whatever the run's seq_len, so variants compare
    blocks = corpus_blocks(None, trainer.tokenizer, 256, split="validation", seed=0,
                           shuffle_buffer=2048)
    batches = [next_batch(blocks, 4) for _ in range(s["val_blocks"] // 4)]
    trainer.loop.validate = lambda: broad_loss(trainer.model, batches)
    trainer.fit(progress=not s["threads"])
    records = curve(cfg.out, cfg.tokens_per_step)
    records[-1]["quickstart_val_loss"] = validation_loss(trainer.model, trainer.tokenizer, cfg)
    records[-1]["wall_seconds"] = time.perf_counter() - start
    return records


def main(run) -> None:
    a = run.args
    s = {"preset": "debug", "steps": 4, "eval_every": 2, "val_blocks": 8} if a.quick else \
        {"preset": "small", "steps": 120, "eval_every": 20, "val_blocks": 64}
    s["threads"] = a.threads or (1 if a.parallel else None)
    variants = dict(map(parse_variant, a.variant)) if a.variant else VARIANTS
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(
            len(variants) if a.parallel else 1, mp_context=get_context("spawn")) as pool:
        jobs = {v: pool.submit(train, v, c, s, tmp) for v, c in variants.items()}
        curves = {v: job.result() for v, job in jobs.items()}
    rows = []
    for v, records in curves.items():
        tail = [r["loss"] for r in records][len(records) * 2 // 3:]
        rows.append({"variant": v, **variants[v],
                     "final_val_loss": [r for r in records if "val_loss" in r][-1]["val_loss"],
                     "quickstart_val_loss": records[-1]["quickstart_val_loss"],
                     "train_loss_last_third_mean": sum(tail) / len(tail),
                     "train_loss_last_third_max": max(tail),
                     "train_seconds": records[-1]["train_seconds"],
                     "wall_seconds": records[-1]["wall_seconds"]})
    title = (f"{s['preset']}, {s['steps']} AdamW steps of 1,024 tokens (the quickstart): "
             f"validation on {s['val_blocks']} blocks across the validation split")
    run.table(title, rows)
    plot_curves(curves, out_dir(run) / f"{stem(run, a.name)}.png", title, batches=True)
    run.save(rows, name=stem(run, a.name), curves=curves, settings=s, variants=variants,
             summary="validation loss " + ", ".join(
                 f"{r['variant']} {r['final_val_loss']:.2f}" for r in rows))
