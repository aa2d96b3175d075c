"""SmolLM2-135M's distilled students keep its perplexity, and its passkey with its own layers.

``hyla distill`` of ``hybrid-auto`` (``auto:7``), ``hybrid`` (every fourth layer) and
``all-linear``, the same flags (80 + 90 steps of 1,024 tokens, full report on held-out code and
prose); then each stage's tokens/s side by side against the earlier ``plain-gla`` recipe.
``--parallel``: the students at once; ``--collect``: read finished runs. ``--quick``: one tiny.
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import train_common as tc
from hyla.perf import time_fn

STUDENTS = {"hybrid": "GGGA" * 7 + "GG", "hybrid-auto": "auto:7", "all-linear": "G" * 30}
SETTINGS = {"window": 64, "sinks": 4, "stage1-steps": 80, "stage2-steps": 90, "seq-len": 1024,
            "batch-size": 1, "lora-rank": 8, "lr": "1e-3", "warmup-steps": 5, "eval-every": 60,
            "eval-batches": 3, "report-tokens": 16384, "report-trials": 8, "save-every": 60}
QUICK = {"stage1-steps": 2, "stage2-steps": 2, "seq-len": 256, "eval-every": 2,
         "eval-batches": 1, "report-tokens": 2048, "report-trials": 2, "save-every": 4}


def add_args(parser) -> None:
    parser.add_argument("--work", default="runs/distill_smollm2", type=pathlib.Path)
    parser.add_argument("--only", nargs="+", choices=sorted(STUDENTS), default=None)
    parser.add_argument("--parallel", action="store_true", help="the students at once")
    parser.add_argument("--collect", action="store_true", help="only read finished runs")


def heldout_dir(out: pathlib.Path, chars: int = 6000) -> pathlib.Path:
    """Stdlib validation files and licence texts, alternating, each cut to ``chars``."""
    from hyla.data.corpus import stdlib_files

    out.mkdir(parents=True, exist_ok=True)
    pairs = itertools.zip_longest(stdlib_files("validation"), tc.prose_files())
    for n, f in enumerate(f for pair in pairs for f in pair if f):
        kind = "prose" if f.parent == tc.LICENSES else "code"
        text = f.read_text(encoding="utf-8", errors="replace")[:chars]
        (out / f"{n:04d}_{kind}_{f.stem}.txt").write_text(text)
    return out


def recipe_throughput(teacher: pathlib.Path, steps: int) -> dict:
    """Tokens/s of each stage, earlier recipe and this one, on the same 512-token blocks:
    medians of ``steps`` steps after a warm-up step of each stage."""
    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig

    rates = {}
    for label, extra in {"earlier": {"recipe": "plain-gla", "autocast": "off"},
                         "this": {"window": 64, "lora_rank": 8, "lr": 1e-3}}.items():
        with tempfile.TemporaryDirectory() as tmp:
            d = Distiller(DistillConfig(teacher=str(teacher), layers="G" * 30, seq_len=512,
                                        stage1_steps=steps + 1, stage2_steps=steps + 1,
                                        batch_size=1, report_tokens=0, shuffle_buffer=8,
                                        eval_batches=1, out=tmp, **extra))
            rates[f"stage 1, {label}"] = 512 / time_fn(d.train_step, repeats=steps)
            d.fit(until=steps + 1, progress=False)       # into stage 2
            rates[f"stage 2, {label}"] = 512 / time_fn(d.train_step, repeats=steps)
            del d                                          # one student in memory at a time
    for s in ("1", "2"):
        rates[f"stage {s} ratio"] = rates[f"stage {s}, this"] / rates[f"stage {s}, earlier"]
    return rates


def row(name: str, work: pathlib.Path, r: dict) -> dict:
    return {"student": name, **tc.report_row(work / name), "state 8K s/t": r["state_ratio_8k"],
            "params s/t": r["parameter_ratio"], "tokens": r["tokens_seen"],
            "s1 tok/s": r["stages"]["1"]["tokens_per_s_median"],
            "s2 tok/s": r["stages"]["2"]["tokens_per_s_median"], "minutes": r["train_seconds"] / 60}


def plot(reports: dict, path: pathlib.Path) -> None:
    fig, ax = tc.figure(1, (6.5, 4))
    for name, r in reports.items():
        ax.plot([c["tokens"] for c in r["curve"]], [c["val_ppl"] for c in r["curve"]],
                marker="o", label=f"{name} student")
    teacher = [c["teacher_val_ppl"] for r in reports.values() for c in r["curve"]]
    if teacher:
        ax.axhline(teacher[-1], color="k", ls="--", label="teacher")
    ax.set(xlabel="tokens seen (stage 1 + stage 2)", ylabel="validation perplexity (stdlib)",
           title="SmolLM2-135M distilled on a CPU")
    ax.legend()
    tc.save_figure(fig, path, dpi=120)


def main(run) -> None:
    a = run.args
    work = a.work / "quick" if a.quick else a.work
    work.mkdir(parents=True, exist_ok=True)
    teacher, heldout = tc.smollm2(work), heldout_dir(work / "heldout")
    flags = [x for k, v in (SETTINGS | QUICK if a.quick else SETTINGS).items()
             for x in (f"--{k}", str(v))] + ["--full-report", "--eval-data", str(heldout)]
    names = ["all-linear"] if a.quick else a.only or list(STUDENTS)
    threads = a.threads or (1 if a.parallel else os.cpu_count())
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for group in [] if a.collect else [names] if a.parallel else [[n] for n in names]:
        run.progress(f"distilling {', '.join(group)} (logs in {work})")
        procs = [subprocess.Popen([sys.executable, "-m", "hyla", "distill", "--teacher",
                                   str(teacher), "--layers", STUDENTS[n], *flags, "--out",
                                   str(work / n), "--no-progress"], env=env,
                                  stdout=open(work / f"{n}.log", "w"), stderr=subprocess.STDOUT)
                 for n in group]
        if any(p.wait() for p in procs):
            raise SystemExit(f"a distillation failed; see {work}/*.log")
    reports = {n: json.loads((work / n / "report.json").read_text()) | {"curve": [
        {k: x[k] for k in ("tokens", "stage", "val_ppl", "teacher_val_ppl")}
        for x in tc.jsonl(work / n / "metrics.jsonl") if "val_ppl" in x]}
        for n in STUDENTS if (work / n / "report.json").is_file()}
    run.progress("recipe throughput")
    rates = recipe_throughput(teacher, 1 if a.quick else 4)
    rows = [row(n, work, r) for n, r in reports.items()]
    run.table("SmolLM2-135M students (s/t: student / teacher)", rows)
    run.table("distillation throughput, tokens/s (ratio: this recipe / the earlier)",
              [{"what": k, "value": v} for k, v in rates.items()])
    plot(reports, tc.out_dir(run) / f"{tc.stem(run)}.png")
    pk = [k for k in (rows or [{}])[0] if k.startswith("passkey")][-1:]
    run.save(rows, students=reports, throughput=rates, settings=flags,
             summary="perplexity at 2,048 vs the teacher's (passkey at 2K): " + ", ".join(
                 f"{r['student']} {r['ratio 2048']:.2f}x ({r[pk[0]]})" for r in rows)
             + f"; this recipe's tokens/s {rates['stage 1 ratio']:.1f}x (stage 1) and "
               f"{rates['stage 2 ratio']:.1f}x (stage 2) the earlier's, side by side")
