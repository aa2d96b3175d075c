"""Distributed Muon's all_to_all trains faster than all_gather at W = 2; Muon costs beside AdamW.

``hyla train --preset small``, 6 steps of 4 x 256 tokens a rank: AdamW and Muon at W = 1, and
with each Muon strategy at W = 2 (torchrun; both ranks share the cores: overheads, not
scaling); median tokens/s after the first step. ``--quick``: ``debug``, 3 steps.
"""

import pathlib
import statistics
import tempfile

from benchmarks.train_common import hyla_train, tokenizer

CASES = [(1, "adamw", None), (1, "muon", None), (2, "adamw", None),
         (2, "muon", "all_gather"), (2, "muon", "all_to_all")]


def main(run) -> None:
    preset, steps = ("debug", 3) if run.args.quick else ("small", 6)
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tokenizer(pathlib.Path(name))
        for world, opt, strategy in CASES:
            run.progress(f"W={world} {opt} {strategy or ''}")
            r = hyla_train(world, pathlib.Path(name, f"w{world}-{opt}-{strategy}"), preset=preset,
                           steps=steps, seq_len=256, batch_size=4, optimizer=opt,
                           flags=["--muon-strategy", strategy] if strategy else [])
            if "error" in r:
                raise SystemExit(r["error"])
            rates = [s["tokens_per_s"] for s in r["steps"][1:]]
            rows.append({"world": world, "optimizer": opt, "muon_strategy": strategy or "-",
                         "tokens_per_s": statistics.median(rates), "steps_timed": len(rates)})
    for r in rows:
        r["vs_w1_adamw"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    run.table(f"training step throughput, {preset}, 1,024 tokens a rank a step", rows)
    t = [r["tokens_per_s"] for r in rows]
    run.save(rows, settings={"preset": preset, "steps": steps},
             summary=f"W=1: AdamW {t[0]:.0f} tok/s, Muon {t[1]:.0f}; W=2: AdamW {t[2]:.0f}, "
                     f"Muon all_gather {t[3]:.0f}, all_to_all {t[4]:.0f} ({t[4] / t[3]:.2f}x)")
