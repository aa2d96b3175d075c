"""FSDP2 on CPU holds 1/W of the parameters and optimizer state a rank, and sends, as planned.

``hyla train --preset small --strategy fsdp`` at W = 1, 2, 4 (torchrun above 1), 4 steps of 4 x
128 tokens a rank, Muon and AdamW, one thread a rank (two OpenMP threads wait on each other's
barriers on a shared machine), the fastest of ``--rounds`` (default 2) alternating runs: bytes a
rank holds and sends, peak RSS and tokens/s beside the plan. ``--quick``: ``debug``, W = 1, 2.
"""

import os
import pathlib
import statistics
import tempfile

from benchmarks.train_common import hyla_train, tokenizer
from hyla.eval.train_memory import train_memory_report

SEQ_LEN, BATCH, OPTIMIZERS = 128, 4, ("muon", "adamw")


def add_args(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.set_defaults(rounds=2)


def train(tmp, preset, world, optimizer, steps, attempt) -> dict:
    r = hyla_train(world, tmp / f"{optimizer}-w{world}-{attempt}", preset=preset, steps=steps,
                   seq_len=SEQ_LEN, batch_size=BATCH, optimizer=optimizer, threads=1,
                   flags=["--strategy", "fsdp"] if world > 1 else [])
    later = r.get("steps", [])[1:]
    return r if "error" in r else {
        **r, "tokens_per_s": statistics.median(s["tokens_per_s"] for s in later),
        "comm_bytes_step": statistics.median(s.get("comm_bytes", 0) for s in later)}


def row(optimizer, world, runs, plan) -> dict:
    done = [r for r in runs if "error" not in r]
    out = {"optimizer": optimizer, "W": world, "runs ok": f"{len(done)}/{len(runs)}"}
    if not done:
        return out
    best = max(done, key=lambda r: r["tokens_per_s"])
    p = best["parallel"]

    def most(key):
        return max(p.get(key) or [0]) / 1e6

    return {**out, "strategy": p.get("strategy", "-"), "tokens/s": best["tokens_per_s"],
            "params MB/rank": most("param_bytes_local"), "planned params MB": plan["params"] / 1e6,
            "optim MB/rank": most("optimizer_bytes"), "planned optim MB": plan["optimizer"] / 1e6,
            "peak RSS MB/rank": most("peak_memory_bytes"), "planned total MB": plan["total"] / 1e6,
            "comm MB/step": best["comm_bytes_step"] / 1e6,
            "planned comm MB": plan["comm_bytes"] / 1e6, "wall s": best["wall_s"]}


def main(run) -> None:
    a = run.args
    preset, worlds, steps, rounds = (("debug", [1, 2], 2, 1) if a.quick
                                     else ("small", a.worlds, 4, a.rounds))
    with tempfile.TemporaryDirectory() as name:
        tmp, attempt = pathlib.Path(name), iter(range(10**6))
        tokenizer(tmp)
        runs = run.rounds({(o, w): lambda o=o, w=w: train(tmp, preset, w, o, steps, next(attempt))
                           for w in worlds for o in OPTIMIZERS}, rounds)
    rows = sorted((row(o, w, mine, train_memory_report(
        preset, world_size=w, seq_len=SEQ_LEN, batch_size=BATCH, optimizer=o)["strategies"][
            "fsdp" if w > 1 else "replicate"]) for (o, w), mine in runs.items()),
        key=lambda r: (OPTIMIZERS.index(r["optimizer"]), r["W"]))
    cores = os.cpu_count()
    run.table(f"FSDP training, {preset}, {BATCH} x {SEQ_LEN} tokens a rank a step, 1 thread a "
              f"rank ({cores} cores shared by all ranks and other processes)", rows)
    run.save(rows, runs=[{"optimizer": o, "W": w, **r} for (o, w), rs in runs.items() for r in rs],
             settings={"preset": preset, "worlds": worlds, "steps": steps, "rounds": rounds,
                       "seq_len": SEQ_LEN, "batch_size": BATCH, "threads_per_rank": 1},
             note="peak RSS is the whole process; comm = the most a rank sent in a step "
                  "(median); planned = hyla memory --train (fp32; its total adds gradients, "
                  f"gathered blocks and activations); {cores} cores: W > {cores} oversubscribed",
             summary="params / optimizer MB a rank (planned): " + "; ".join(
                 f"{r['optimizer']} W={r['W']} {r['params MB/rank']:.1f} / "
                 f"{r['optim MB/rank']:.1f} ({r['planned params MB']:.1f} / "
                 f"{r['planned optim MB']:.1f})" for r in rows if "tokens/s" in r))
