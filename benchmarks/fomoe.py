"""FoMoE sends >= 1.4x less than DiLoCo and >= 20x less than FSDP, its loss within 10% of FSDP's.

At ``--sync-every 16``, and token skipping gives >= 1.2x DiLoCo's tokens/s: ``hyla train
--preset small-moe``, torchrun at W = 2, 4 (a thread a rank), 32 steps of 4 x 64 tokens a rank,
the same data for ``fsdp``, ``diloco`` and ``fomoe`` (R = 1 with and without token skipping,
W/2); the median of ``--rounds`` (default 1). ``--quick``: ``debug-moe``, W = 2.
"""

import pathlib
import statistics
import tempfile

from benchmarks.train_common import hyla_train, stem, tokenizer

TARGETS = {"comm_vs_diloco": 1.4, "comm_vs_fsdp": 20.0, "val_loss_rel": 0.10,
           "skip_tokens_per_s_vs_diloco": 1.2}
S, C, V, T = "fomoe R=1 skip", "comm B/token", "val loss", "tokens/s"
RATIOS = {"comm_vs_diloco": ("diloco", S, C, 0), "skip_tokens_per_s_vs_diloco": (S, "diloco", T, 0),
          "comm_vs_fsdp": ("fsdp", S, C, 0), "val_loss_rel": (S, "fsdp", V, 1),  # a / b - last
          "diloco_comm_vs_fsdp": ("fsdp", "diloco", C, 0),
          "diloco_val_loss_rel": ("diloco", "fsdp", V, 1),
          "skip_tokens_per_s_vs_no_skip": (S, "fomoe R=1 no-skip", T, 0)}
COLUMNS = {C: "comm_bytes_per_token", V: "val_loss", T: "tokens_per_s",
           "median step tokens/s": "median_step_tokens_per_s"}
SUMMARY = {"comm_vs_diloco": "{:.2f}x less comm than DiLoCo", "comm_vs_fsdp": "{:.1f}x than FSDP",
           "val_loss_rel": "val loss {:+.1%} vs FSDP",
           "skip_tokens_per_s_vs_diloco": "{:.2f}x DiLoCo's tokens/s"}


def add_args(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--outer-lr", type=float, default=None, help="default: hyla's (0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="default: hyla's (0.9)")
    parser.add_argument("--only", nargs="+", default=None, help="these labels (e.g. diloco)")
    parser.add_argument("--name", default="fomoe", help="results name")
    parser.set_defaults(rounds=1)


def variants(world: int) -> dict[str, list[str]]:
    """The ``hyla train`` flags of every strategy run at ``world`` ranks."""
    fomoe = ["--strategy", "fomoe", "--expert-replicas"]
    return {"fsdp": ["--strategy", "fsdp"], "diloco": ["--strategy", "diloco"],
            S: [*fomoe, "1", "--token-skipping"],
            "fomoe R=1 no-skip": [*fomoe, "1", "--no-token-skipping"],
            **({f"fomoe R={world // 2} skip": [*fomoe, str(world // 2), "--token-skipping"]}
               if world > 2 else {})}


def figures(r: dict) -> dict:
    """What a finished run measured: comm over global tokens, tokens/s over step seconds."""
    steps, val = r["steps"], [x["val_loss"] for x in r["records"] if "val_loss" in x]
    tokens, later = steps[-1]["tokens"], steps[1:] or steps
    comm = sum(x.get("comm_bytes", 0) for x in steps)
    return {"wall_s": r["wall_s"], "tokens": tokens, "comm_bytes_total": comm,
            "comm_bytes_per_token": comm / tokens,
            "tokens_per_s": len(later) / sum(1 / x["tokens_per_s"] for x in later),
            "median_step_tokens_per_s": statistics.median(x["tokens_per_s"] for x in later),
            "val_loss": val[-1] if val else None, "final_train_loss": steps[-1]["loss"],
            "expert_load_entropy_last": steps[-1].get("expert_load_entropy"),
            "parallel": {k: v for k, v in r["parallel"].items() if k != "mesh"}}


def summarise(runs: list[dict]) -> tuple[list[dict], dict]:
    """A row a (W, strategy) (medians over rounds) and the targets' ratios at every W."""
    rows, by, checks = [], {}, {}
    for key in dict.fromkeys((r["world"], r["label"]) for r in runs):
        ok = [r for r in runs if (r["world"], r["label"]) == key and "error" not in r]
        rows.append({"W": key[0], "strategy": key[1]} | ({} if ok else {"status": "failed"}))
        if ok:
            p = ok[0]["parallel"]
            rows[-1] |= {k: statistics.median(r[v] for r in ok) for k, v in COLUMNS.items()} | {
                "params MB/rank": max(p.get("param_bytes_local") or [0]) / 1e6,
                "params MB total": (p.get("param_bytes_total") or 0) / 1e6, "repeats": len(ok)}
            by[key] = rows[-1]
    for w in dict.fromkeys(r["world"] for r in runs):
        c = {k: by[w, a][col] / by[w, b][col] - minus for k, (a, b, col, minus) in RATIOS.items()
             if (w, a) in by and (w, b) in by}
        checks[f"W={w}"] = {"ratios": c, "met": {
            k: abs(c[k]) <= t if k == "val_loss_rel" else c[k] >= t
            for k, t in TARGETS.items() if k in c}}
    return rows, checks


def main(run) -> None:
    a = run.args
    preset, worlds, steps, sync = (("debug-moe", [2], 8, 4) if a.quick
                                   else ("small-moe", a.worlds, 32, 16))
    outer = [x for flag, v in (("--outer-lr", a.outer_lr), ("--outer-momentum", a.outer_momentum))
             if v is not None for x in (flag, str(v))]
    settings = {"preset": preset, "worlds": worlds, "steps": steps, "sync_every": sync,
                "seq_len": 64, "batch_size": 4, "optimizer": "adamw", "eval_batches": 4, "seed": 0,
                "rounds": a.rounds, "outer": outer, "only": a.only, "threads_per_rank": 1}
    runs: list[dict] = []

    def one(tmp, world, label, flags):
        r = hyla_train(world, tmp / f"w{world}-{label.replace(' ', '_')}-{len(runs)}",
                       preset=preset, steps=steps, seq_len=64, batch_size=4, optimizer="adamw",
                       eval_batches=4,
                       threads=1, flags=["--sync-every", str(sync), "--seed", "0", *flags,
                                         *(outer if label != "fsdp" else [])])
        runs.append({"world": world, "label": label, **(r if "error" in r else figures(r))})
        rows, checks = summarise(runs)   # saved after every run: a cut-short run keeps its part
        run.save(rows, name=stem(run, a.name), settings=settings, targets=TARGETS, checks=checks,
                 runs=runs, summary="FoMoE R=1 " + "; ".join(f"{w}: " + ", ".join(
                     SUMMARY[k].format(v) for k, v in c["ratios"].items() if k in SUMMARY)
                     for w, c in checks.items()))

    with tempfile.TemporaryDirectory() as d:
        tokenizer(tmp := pathlib.Path(d))
        run.rounds({f"W={w} {label}": lambda w=w, label=label, f=f: one(tmp, w, label, f)
                    for w in worlds for label, f in variants(w).items()
                    if a.only is None or label in a.only})
    run.table(f"FoMoE vs DiLoCo vs FSDP ({preset}, {steps} steps, H = {sync})", summarise(runs)[0])
