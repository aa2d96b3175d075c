"""Muon reaches AdamW's validation loss in fewer steps; a step costs more on a CPU.

``small``, 60 steps of 4 x 256 tokens, same start and data, Muon (0.02; AdamW 3e-3 on the rest)
against AdamW (3e-3): validation loss by step and by training seconds (``train_small.png``).
``--quick``: ``debug``, 10 steps.
"""

import tempfile

from benchmarks.train_common import curve, out_dir, plot_curves, stem
from hyla.train.config import TrainConfig
from hyla.train.trainer import Trainer

LEARNING_RATES = {"muon": {"muon_lr": 0.02, "lr": 3e-3}, "adamw": {"lr": 3e-3}}


def main(run) -> None:
    preset, steps = ("debug", 10) if run.args.quick else ("small", 60)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for opt, lrs in LEARNING_RATES.items():
            run.progress(opt)
            cfg = TrainConfig(preset=preset, steps=steps, seq_len=256, batch_size=4,
                              optimizer=opt, warmup_steps=5, eval_every=10, eval_batches=4,
                              save_every=steps, out=f"{tmp}/{opt}", seed=0, **lrs)
            Trainer(cfg).fit(progress=True)
            curves[opt] = curve(cfg.out, cfg.tokens_per_step)
    # short runs on few files are noisy and not monotone: compare against AdamW's best
    val = {opt: [r for r in records if "val_loss" in r] for opt, records in curves.items()}
    best = min(r["val_loss"] for r in val["adamw"])
    rows = []
    for opt, records in curves.items():
        reach = next((r for r in val[opt] if r["val_loss"] <= best), None)
        rows.append({"optimizer": opt, "final_val_loss": val[opt][-1]["val_loss"],
                     "best_val_loss": min(r["val_loss"] for r in val[opt]),
                     "steps_to_adamw_best": reach and reach["step"],
                     "seconds_to_adamw_best": reach and reach["train_seconds"],
                     "train_seconds": records[-1]["train_seconds"],
                     "sec_per_step": records[-1]["train_seconds"] / len(records)})
    run.table(f"{preset}: Muon vs AdamW, {steps} steps of 1,024 tokens", rows)
    plot_curves(curves, out_dir(run) / f"{stem(run)}.png", "Muon vs AdamW")
    m, a = rows
    run.save(rows, curves=curves, settings={"preset": preset, "steps": steps},
             summary=f"final validation loss Muon {m['final_val_loss']:.2f} vs AdamW "
                     f"{a['final_val_loss']:.2f}; Muon reaches AdamW's best at step "
                     f"{m['steps_to_adamw_best']} (AdamW {a['steps_to_adamw_best']}), "
                     f"{m['sec_per_step'] / a['sec_per_step']:.1f}x its seconds a step")
