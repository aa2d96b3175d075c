"""Recall by load, teacher against its distilled students (issue 33, part 3).

Text key-value recall (:mod:`hyla.eval.recall.text`: ``" The code of Kobi is 4821."`` facts,
then ``" The code of Kobi is"``, exact match of the greedy answer) for the SmolLM2-135M
teacher and each student that ``benchmarks/distill_smollm2.py`` (or a shorter run of the same
recipe) left in ``--work``, beside each student's held-out perplexity and passkey from its
``report.json``: where the fixed state starts to lose what the softmax layers kept.

    python benchmarks/recall_distill.py --work runs/distill_smollm2
    python benchmarks/recall_distill.py --work runs/recall33 --students all-linear

Writes ``benchmarks/results/recall_distill/`` (``results.json`` in the recall sweep's form,
``summary.json`` with the perplexity / passkey beside the curves, ``accuracy_vs_pairs.png``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hyla.eval.recall.plots import plot_recall, write_recall  # noqa: E402
from hyla.eval.recall.text import PAIRS, text_recall  # noqa: E402
from hyla.model.load import load_model  # noqa: E402
from hyla.perf import machine_info  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "recall_distill"
STUDENTS = ("hybrid-auto", "hybrid", "all-linear")


def report_figures(run: pathlib.Path) -> dict:
    """Perplexity and passkey of a student and its teacher, from the run's report.json."""
    path = run / "report.json"
    if not path.is_file():
        return {}
    r = json.loads(path.read_text())
    out = {"tokens_seen": r.get("tokens_seen"), "layers": r.get("layers")}
    for who in ("student", "teacher"):
        f = r.get(f"{who}_figures", {})
        out[f"{who}_perplexity"] = {n: v["perplexity"] for n, v in f.get("perplexity",
                                                                           {}).items()}
        out[f"{who}_passkey"] = {n: f"{v['correct']}/{v['trials']}"
                                 for n, v in f.get("passkey", {}).items()}
    return out


def accuracy_row(records: list[dict], context: str) -> str:
    return " ".join(f"{r['accuracy']:5.2f}" for r in records if r["context"] == context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=pathlib.Path, default=ROOT / "runs" / "distill_smollm2",
                    help="folder of the distillation runs (default: %(default)s)")
    ap.add_argument("--students", default=",".join(STUDENTS),
                    help="comma-separated run names under --work; missing ones are skipped "
                         "(default: %(default)s)")
    ap.add_argument("--teacher", default="smollm2",
                    help="the teacher, any load_model source (default: %(default)s)")
    ap.add_argument("--pairs", default=",".join(map(str, PAIRS)),
                    help="comma-separated loads (default: %(default)s)")
    ap.add_argument("--context", default="growing,fixed",
                    help="context kinds, growing and/or fixed (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=16,
                    help="questions per load and context kind (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, every core)")
    ap.add_argument("--teacher-results", type=pathlib.Path, default=None,
                    help="results.json of an earlier `hyla eval recall --checkpoint` run of "
                         "the teacher with the same pairs, limit and seed, reused instead of "
                         "measuring it again (default: measure it)")
    ap.add_argument("--out", type=pathlib.Path, default=OUT,
                    help="results folder (default: %(default)s)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = [int(p) for p in args.pairs.split(",")]
    contexts = [c for c in args.context.split(",") if c]
    models = [("teacher", args.teacher, None)]
    for name in args.students.split(","):
        run = args.work / name
        if (run / "config.json").is_file() or any(run.glob("ckpt-*")):
            models.append((name, str(run), run))
        else:
            print(f"skipping {name}: no run in {run}")
    records, summary = [], {}
    for label, source, run in models:
        start = time.perf_counter()
        if label == "teacher" and args.teacher_results:
            recs = [{**r, "mixer": label, "description": f"{label}, {r['context']} context"}
                    for r in json.loads(args.teacher_results.read_text())
                    if r["num_kv_pairs"] in pairs and r["context"] in contexts]
            layers = "reused: " + args.teacher_results.parent.name
        else:
            model, tok = load_model(source)
            layers = model.cfg.layers
            with torch.inference_mode():
                recs = text_recall(model, tok, pairs, contexts=contexts, limit=args.limit,
                                   seed=args.seed, name=label,
                                   progress=lambda line: print(line, flush=True))
            del model
        seconds = time.perf_counter() - start
        records += recs
        summary[label] = {"layers": layers, "seconds": round(seconds, 1),
                          "accuracy": {c: {r["num_kv_pairs"]: r["accuracy"] for r in recs
                                           if r["context"] == c} for c in contexts},
                          **(report_figures(run) if run else {})}
    write_recall(records, args.out, benchmark="recall_distill", pairs=pairs,
                 contexts=contexts, limit=args.limit, seed=args.seed,
                 work=args.work.name, machine=machine_info())
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_recall(records, args.out, title="key-value recall in text: SmolLM2-135M and students")
    print(f"\n{'model':<12} {'context':<8} " + " ".join(f"{p:>5}" for p in pairs)
          + "   ppl 512/2048     passkey")
    for label, s in summary.items():
        ppl = s.get("student_perplexity") or {}
        pk = s.get("student_passkey") or {}
        if label == "teacher" and len(summary) > 1:
            other = next((v for k, v in summary.items() if k != "teacher"
                          and v.get("teacher_perplexity")), {})
            ppl, pk = other.get("teacher_perplexity", {}), other.get("teacher_passkey", {})
        for c in contexts:
            extra = (f"   {'/'.join(f'{v:.2f}' for v in ppl.values()):<15} "
                     f"{', '.join(f'{k}: {v}' for k, v in pk.items())}") if c == contexts[0] \
                else ""
            mine = [r for r in records if r["mixer"] == label]
            print(f"{label:<12} {c:<8} {accuracy_row(mine, c)}" + extra)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
