"""SmolLM2's induction and reach probes choose better attention layers than KL, faster.

The 30 layers ranked (1 thread unless ``--threads``) by induction, reach (attention beyond a
64-token window + 4 sinks) and the KL each layer's attention removes from the all-linear
student: top 7s, patterns, seconds. ``--distill``: a student of each pattern at equal tokens,
scored with the teacher on held-out code and prose and passkey at 1K. ``--quick``: 128 tokens.
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import time
import types

import torch

from benchmarks.train_common import heldout, out_dir, scores, stem

WINDOW, SINKS, KEEP = 64, 4, 7
# every distillation flag explicit (activation checkpointing and a small vocabulary chunk
# change memory only: a shared 2-core, 23 GB machine killed a run without them)
FLAGS = ["--window", str(WINDOW), "--sinks", str(SINKS), "--lora-rank", "8", "--lr", "1e-3",
         "--warmup-steps", "5", "--batch-size", "1", "--report-tokens", "0", "--save-every",
         "1000", "--eval-batches", "1", "--seed", "0", "--activation-checkpointing",
         "--vocab-chunk", "256", "--no-progress"]


def add_args(parser) -> None:
    parser.add_argument("--distill", action="store_true", help="and distil a student of each")
    parser.add_argument("--steps", type=int, default=20, help="steps of each stage")
    parser.add_argument("--work", default=None, help="folder of the distillations (reused)")


def rankings(run, seq: int) -> dict:
    from hyla.train.distill import load_teacher
    from hyla.train.distill.kl_ranking import restored_kl
    from hyla.train.distill.layer_ranking import choose_layers, far_attention, induction_scores
    from hyla.train.distill.student import probe_block

    start = time.perf_counter()
    teacher, tok = load_teacher("smollm2")
    load_s, n, timing = time.perf_counter() - start, teacher.cfg.n_layers, {}
    probe = probe_block(types.SimpleNamespace(data=None, stage1_len=seq, seed=0), tok)
    kw = {"window": WINDOW, "sinks": SINKS}

    def timed(name, fn, *args, **kwargs):
        run.progress(name)
        start = time.perf_counter()
        out = fn(teacher, *args, **kwargs)
        timing[name] = round(time.perf_counter() - start, 1)
        return out

    induction = timed("induction", induction_scores)
    reach = timed("reach", far_attention, *probe, **kw)
    probes = timed("probes", choose_layers, f"auto:{KEEP}", probe, **kw)
    base, restored = timed("kl", restored_kl, [probe], **kw)
    kl = [base - r for r in restored]
    tops = {name: sorted(sorted(range(n), key=lambda i: -x[i])[:KEEP])
            for name, x in (("induction", induction), ("reach", reach), ("kl", kl))}
    tops["probes"] = [i for i, c in enumerate(probes) if c == "A"]
    return {"teacher_load_s": round(load_s, 1), "layers": n, "probe_tokens": probe[0].numel(),
            "scores": {"induction": induction, "reach": reach, "kl_drop": kl},
            "kl_all_linear": base, "kl_restored": restored, "top": tops, "timing": timing,
            "patterns": {"probes": probes,
                         "kl": "".join("A" if i in tops["kl"] else "G" for i in range(n))}}


def distill(run, patterns: dict, steps: int, work: pathlib.Path, seq: int, tokens: int,
            trials: int) -> dict:
    from hyla.model.load import load_model

    results = {"teacher": {}}
    for name, pattern in patterns.items():          # distil first: one model in memory
        done = work / name / "done"
        if not done.is_file():
            run.progress(f"distilling the {name} student")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "hyla", "distill", "--teacher", "smollm2",
                            "--layers", pattern, *FLAGS, "--seq-len", str(seq), "--stage1-steps",
                            str(steps), "--stage2-steps", str(steps), "--out", str(work / name)],
                           check=True)
            done.write_text(json.dumps({"seconds": time.perf_counter() - start}))
        results[name] = {"pattern": pattern,
                         "distill_s": round(json.loads(done.read_text())["seconds"], 1)}
    sets = heldout(work, 6000)
    for name in results:                            # each model's scores kept in work
        done = work / f"scores_{name}.json"
        if not done.is_file():
            run.progress(f"scoring {name}")
            model, tok = load_model("smollm2" if name == "teacher" else str(work / name))
            done.write_text(json.dumps(scores(model, tok, sets, tokens=tokens, seq_len=seq,
                                              passkey=1024, trials=max(1, trials // 2))))
        results[name] |= json.loads(done.read_text())
    return {"steps_each_stage": steps, "tokens_each": 2 * steps * seq, "flags": " ".join(FLAGS),
            "eval_tokens": tokens, "passkey_trials": trials, "results": results}


def main(run) -> None:
    a = run.args
    seq, steps, tokens, trials = (128, 1, 512, 2) if a.quick else (1024, a.steps, 8192, 8)
    torch.set_num_threads(a.threads or 1)
    path = out_dir(run) / f"{stem(run)}.json"
    # --distill reuses the rankings on file; a rankings run keeps the distillations on file
    old = json.loads(path.read_text()) if path.is_file() else {}
    ranked = old["rankings"] if a.distill and "rankings" in old else rankings(run, seq)
    trained = old.get("distill")
    if a.distill:
        work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="layer_ranking_"))
        trained = distill(run, ranked["patterns"], steps, work, seq, tokens, trials)
    rows = [{"ranking": k, "top-7 layers": str(v), "seconds": ranked["timing"].get(k)}
            for k, v in ranked["top"].items()]
    run.table(f"layer rankings (KL all-linear {ranked['kl_all_linear']:.3f} nats/token)", rows)
    summary = ", ".join(f"{k} {ranked['top'][k]} ({ranked['timing'].get(k)} s)"
                        for k in ("probes", "kl"))
    if trained:
        students = [{"model": k, **v} for k, v in trained["results"].items()]
        run.table("students at equal tokens: held-out perplexity and passkey", students)
        summary += "; code / prose perplexity, passkey: " + ", ".join(
            f"{s['model']} {s['ppl_code']:.2f} / {s.get('ppl_prose', 0):.2f}, {s['passkey']}"
            for s in students)
    run.save(rows, rankings=ranked, distill=trained, teacher="smollm2", window=WINDOW,
             sinks=SINKS, keep=KEEP, probe_seq_len=seq, threads=torch.get_num_threads(),
             summary=summary)
