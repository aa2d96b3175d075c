"""Which SmolLM2 layers stay softmax attention: three rankings side by side (issue 35, item 5).

For ``hyla distill --layers auto:7`` on SmolLM2-135M-Instruct (30 layers), the teacher's
layers ranked by

- induction (:func:`hyla.train.distill.layer_ranking.induction_scores`): attention to the token
  after a previous occurrence, on random tokens repeated once;
- reach (:func:`~hyla.train.distill.layer_ranking.far_attention`): attention share beyond a
  64-token window and 4 sinks, on the probe block (the first 1,024-token training block);
- KL (:func:`hyla.train.distill.kl_ranking.restored_kl`): the vocabulary KL(teacher ||
  student) each layer's softmax attention removes when put back alone into the calibrated,
  untrained all-linear windowed student, on the same probe block;

the top 7 of each, their overlaps, the ``probes`` pattern (induction and reach in turn, the
default of ``auto:7``), the ``kl`` pattern, and the seconds each ranking took (1 thread).

``--distill`` then distils two students at equal tokens, every flag explicit, one with the
probes' layers and one with KL's (``--layers PATTERN``), and scores each beside the teacher:
perplexity on held-out text (the stdlib validation split, code, and the software licences of
/usr/share/common-licenses, prose; 1,024-token windows) and passkey retrieval at 1K tokens.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/layer_ranking.py
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/layer_ranking.py --distill --steps 20

Writes ``benchmarks/results/layer_ranking.json`` (a --distill run adds to the rankings).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "layer_ranking.json"
LICENSES = pathlib.Path("/usr/share/common-licenses")
PROSE = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD")
WINDOW, SINKS, KEEP, SEQ = 64, 4, 7, 1024
# every distillation flag explicit (activation checkpointing and a small vocabulary chunk
# change memory only: a shared 2-core, 23 GB machine killed a run without them)
FLAGS = ["--window", str(WINDOW), "--sinks", str(SINKS), "--lora-rank", "8", "--lr", "1e-3",
         "--warmup-steps", "5", "--seq-len", str(SEQ), "--batch-size", "1",
         "--report-tokens", "0", "--save-every", "1000", "--eval-batches", "1", "--seed", "0",
         "--activation-checkpointing", "--vocab-chunk", "256", "--no-progress"]


def _top(scores: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:k])


def _pattern(keep: list[int], n: int) -> str:
    return "".join("A" if i in keep else "G" for i in range(n))


def _load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rankings(teacher_name: str) -> dict:
    from hyla.train.distill import load_teacher
    from hyla.train.distill.kl_ranking import restored_kl
    from hyla.train.distill.layer_ranking import choose_layers, far_attention, induction_scores
    from hyla.train.distill.student import probe_block

    t0 = time.perf_counter()
    teacher, tok = load_teacher(teacher_name)
    load_s = time.perf_counter() - t0
    n = teacher.cfg.n_layers
    probe = probe_block(types.SimpleNamespace(data=None, stage1_len=SEQ, seed=0), tok)
    timed = {}

    def run(name, fn):
        start = time.perf_counter()
        out = fn()
        timed[name] = {"seconds": round(time.perf_counter() - start, 1), "load_avg": _load_avg()}
        print(f"{name}: {timed[name]['seconds']} s (load {timed[name]['load_avg']})", flush=True)
        return out

    induction = run("induction", lambda: induction_scores(teacher))
    reach = run("reach", lambda: far_attention(teacher, *probe, window=WINDOW, sinks=SINKS))
    probes = run("probes_pattern", lambda: choose_layers(teacher, f"auto:{KEEP}", probe,
                                                         window=WINDOW, sinks=SINKS))
    base, restored = run("kl", lambda: restored_kl(teacher, [probe], window=WINDOW,
                                                   sinks=SINKS))
    kl = [base - r for r in restored]
    tops = {"induction": _top(induction, KEEP), "reach": _top(reach, KEEP),
            "kl": _top(kl, KEEP),
            "probes": [i for i, c in enumerate(probes) if c == "A"]}
    names = list(tops)
    overlap = {f"{a}&{b}": sorted(set(tops[a]) & set(tops[b]))
               for j, a in enumerate(names) for b in names[j + 1:]}
    return {"teacher_load_s": round(load_s, 1), "layers": n, "probe_tokens": probe[0].numel(),
            "scores": {"induction": induction, "reach": reach, "kl_drop": kl},
            "kl_all_linear": base, "kl_restored": restored, "top": tops, "overlap": overlap,
            "patterns": {"probes": probes, "kl": _pattern(tops["kl"], n)}, "timing": timed}


def heldout_prose(work: pathlib.Path, chars: int = 6000) -> pathlib.Path | None:
    files = [LICENSES / name for name in PROSE if (LICENSES / name).is_file()]
    if not files:
        return None
    out = work / "prose"
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        (out / f"{f.name}.txt").write_text(f.read_text(encoding="utf-8",
                                                       errors="replace")[:chars])
    return out


def scores(model, tok, prose, *, tokens: int, trials: int) -> dict:
    from hyla.eval.needle import needle_eval
    from hyla.eval.perplexity import perplexity

    model.eval()
    out = {"ppl_code": perplexity(model, tok, None, seq_len=SEQ, max_tokens=tokens,
                                  batch_size=1)["perplexity"]}
    if prose is not None:
        out["ppl_prose"] = perplexity(model, tok, prose, seq_len=SEQ, max_tokens=tokens,
                                      batch_size=1)["perplexity"]
    cells = needle_eval(model, tok, [SEQ], (0.25, 0.75), trials=max(1, trials // 2))
    out["passkey_1k"] = f"{sum(c['correct'] for c in cells)}/{sum(c['trials'] for c in cells)}"
    return out


def distill(teacher_name: str, patterns: dict, steps: int, work: pathlib.Path, *,
            tokens: int, trials: int) -> dict:
    from hyla.model.load import load_model
    from hyla.train.distill import load_teacher

    prose = heldout_prose(work)
    runs = {}
    for name, pattern in patterns.items():          # distil first: one model in memory
        out = work / name
        cmd = [sys.executable, "-m", "hyla", "distill", "--teacher", teacher_name,
               "--layers", pattern, *FLAGS, "--stage1-steps", str(steps),
               "--stage2-steps", str(steps), "--out", str(out)]
        start = time.perf_counter()
        if not (out / "done").is_file():
            subprocess.run(cmd, check=True, cwd=ROOT)
            (out / "done").write_text(json.dumps({"seconds": time.perf_counter() - start,
                                                   "load_avg": _load_avg()}))
        done = json.loads((out / "done").read_text())
        if not isinstance(done, dict):          # seconds alone: no load average kept
            done = {"seconds": done, "load_avg": None}
        runs[name] = {"pattern": pattern, "load_avg_at_end": done["load_avg"],
                      "distill_s": round(done["seconds"], 1)}
        print(name, runs[name], flush=True)
    results = {}
    for name, run in {"teacher": {}, **runs}.items():   # each model's scores kept in work
        done = work / f"scores_{name}.json"
        if not done.is_file():
            model, tok = (load_teacher(teacher_name) if name == "teacher" else
                          load_model(str(work / name)))
            done.write_text(json.dumps(scores(model, tok, prose, tokens=tokens,
                                              trials=trials)))
            del model
        results[name] = {**run, **json.loads(done.read_text())}
        print(name, results[name], flush=True)
    return {"steps_each_stage": steps, "tokens_each": 2 * steps * SEQ,
            "flags": " ".join(FLAGS),
            "eval_tokens": tokens, "passkey_trials": trials, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2",
                    help="all-attention teacher (default: %(default)s)")
    ap.add_argument("--distill", action="store_true",
                    help="also distil a probes-chosen and a KL-chosen student at equal tokens "
                         "(default: rankings only)")
    ap.add_argument("--steps", type=int, default=20,
                    help="steps of each distillation stage (default: %(default)s)")
    ap.add_argument("--eval-tokens", type=int, default=8192,
                    help="held-out tokens a perplexity (default: %(default)s)")
    ap.add_argument("--trials", type=int, default=8,
                    help="passkey trials at 1K tokens (default: %(default)s)")
    ap.add_argument("--work", default=None,
                    help="folder for the distillation runs (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # --distill reuses the rankings on file; a rankings run keeps the distillations on file
    # (each records the pattern it trained)
    report = json.loads(OUT.read_text()) if OUT.is_file() else {}
    if "rankings" not in report or not args.distill:
        report = {"benchmark": "layer_ranking", "machine": platform.machine(),
                  "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "teacher": args.teacher,
                  "window": WINDOW, "sinks": SINKS, "keep": KEEP,
                  "rankings": rankings(args.teacher),
                  **({"distill": report["distill"]} if "distill" in report else {})}
    r = report["rankings"]
    print(f"\n{'ranking':<10} {'top-7 layers (0-based)':<32} seconds")
    for name in ("induction", "reach", "probes", "kl"):
        secs = r["timing"].get(name if name != "probes" else "probes_pattern", {})
        print(f"{name:<10} {str(r['top'][name]):<32} {secs.get('seconds', '')}")
    for k, v in r["overlap"].items():
        print(f"overlap {k:<20} {len(v)}  {v}")
    print(f"KL all-linear {r['kl_all_linear']:.3f} nats/token; patterns {r['patterns']}")
    if args.distill:
        work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="layer_ranking_"))
        report["distill"] = distill(args.teacher, r["patterns"], args.steps, work,
                                    tokens=args.eval_tokens, trials=args.trials)
        print(f"\n{'model':<10} {'ppl code':>9} {'ppl prose':>9} passkey  seconds")
        for name, x in report["distill"]["results"].items():
            print(f"{name:<10} {x['ppl_code']:>9.2f} {x.get('ppl_prose', float('nan')):>9.2f} "
                  f"{x['passkey_1k']:>7}  {x.get('distill_s', '')}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
