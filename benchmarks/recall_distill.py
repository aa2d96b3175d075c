"""Distilled SmolLM2 students recall text key-value pairs as the teacher does, up to a load.

Text key-value recall (:mod:`hyla.eval.recall.text`) of SmolLM2-135M-Instruct and each student
run in ``--work`` beside its ``report.json``, into ``recall_distill/``; ``--teacher-results``
reuses a ``hyla eval recall --checkpoint`` run of the teacher. ``--quick``: 2 and 4 pairs, 2
questions, growing context.
"""

import json
import pathlib
import time

import torch

from benchmarks.train_common import out_dir, report_row, stem
from hyla.eval.recall.plots import plot_recall, write_recall
from hyla.eval.recall.text import PAIRS, text_recall
from hyla.model.load import load_model


def add_args(parser) -> None:
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("runs/distill_smollm2"))
    parser.add_argument("--students", default="hybrid-auto,hybrid,all-linear",
                        help="run names under --work; missing ones are skipped")
    parser.add_argument("--pairs", default=",".join(map(str, PAIRS)), help="comma-separated")
    parser.add_argument("--context", default="growing,fixed", help="growing and/or fixed")
    parser.add_argument("--limit", type=int, default=16, help="questions a load and context")
    parser.add_argument("--teacher-results", type=pathlib.Path, default=None,
                        help="results.json of the teacher's `hyla eval recall --checkpoint`")


def main(run) -> None:
    a = run.args
    pairs, contexts, limit = (([2, 4], ["growing"], 2) if a.quick else (
        [int(p) for p in a.pairs.split(",")], [c for c in a.context.split(",") if c], a.limit))
    models = {"teacher": "smollm2"}
    for name in a.students.split(","):
        if (a.work / name / "config.json").is_file() or any((a.work / name).glob("ckpt-*")):
            models[name] = str(a.work / name)
        else:
            run.progress(f"skipping {name}: no run in {a.work / name}")
    records, summary, rows = [], {}, []
    for label, source in models.items():
        run.progress(label)
        start = time.perf_counter()
        if label == "teacher" and a.teacher_results:
            recs = [{**r, "mixer": label, "description": f"{label}, {r['context']} context"}
                    for r in json.loads(a.teacher_results.read_text())
                    if r["num_kv_pairs"] in pairs and r["context"] in contexts]
            layers = "reused: " + a.teacher_results.parent.name
        else:
            model, tok = load_model(source)
            layers = model.cfg.layers
            with torch.inference_mode():
                recs = text_recall(model, tok, pairs, contexts=contexts, limit=limit, seed=0,
                                   name=label, progress=run.progress)
            del model
        records += recs
        report = report_row(pathlib.Path(source)) if label != "teacher" else {}
        summary[label] = {"layers": layers, "seconds": round(time.perf_counter() - start, 1),
                          "report": report}
        for c in contexts:
            acc = {r["num_kv_pairs"]: r["accuracy"] for r in recs if r["context"] == c}
            summary[label][c] = acc
            rows.append({"model": label, "context": c, **{f"{p} pairs": acc.get(p) for p in pairs},
                         **report})
    folder = out_dir(run, stem(run))
    write_recall(records, folder, benchmark="recall_distill", pairs=pairs, contexts=contexts,
                 limit=limit, seed=0, work=a.work.name)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_recall(records, folder, title="key-value recall in text: SmolLM2-135M and students")
    run.table("key-value recall in text: accuracy by pairs", rows)
    run.save(rows, summary=f"accuracy at {pairs[0]} ... {pairs[-1]} pairs ({contexts[0]}): "
             + "; ".join(f"{r['model']} " + ", ".join(f"{r[f'{p} pairs']:.2f}" for p in pairs)
                         for r in rows if r["context"] == contexts[0]))
