"""Claim under test: ``hyla distill`` turns an attention teacher into a hybrid that beats the
same hybrid trained from scratch on the same tokens, with stage 1 running at lengths where a
materialised attention KL could not.

On this CPU, at a stated scale:
1. train an all-attention ``small`` teacher (8 x A) on the embedded stdlib corpus;
2. export it with ``hyla export --format llama`` (a transformers directory);
3. distil it (from that directory) into ``GGGAGGGA`` (A layers compressed to 2 KV heads, so
   stage 1 uses StreamKL) and ``GGGGGGGG`` students;
4. train each student's architecture from scratch on as many tokens as its distillation saw;
5. report validation perplexity (teacher; students after stage 1 and 2; scratch), passkey
   retrieval ("needle"), and state bytes per sequence at 8K against the teacher's KV cache;
6. run one stage-1 step at ``--long-context`` tokens (default 16,384) in a subprocess, and the
   materialised KL of one layer at that length under the same address-space cap.

    python benchmarks/distill_small.py            # ~15-20 minutes on 2 cores
    python benchmarks/distill_small.py --quick    # a smoke run

Writes ``benchmarks/results/distill_small.json`` and ``distill_small.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from hyla.perf import RESULTS_DIR, print_table, tune_cpu_allocator, write_results

STUDENTS = {"GGGA": ("GGGA" * 2, 2), "GGGG": ("G" * 8, None)}


def _register_presets(student_cfgs: dict) -> None:
    from hyla.model.config import PRESETS, small

    PRESETS["small-attention"] = lambda: dataclasses.replace(small(), layers="A" * 8)
    for name, cfg in student_cfgs.items():
        PRESETS[f"scratch-{name}"] = (lambda c=cfg: dataclasses.replace(c))


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def _done(run: pathlib.Path, steps: int) -> bool:
    """A finished run in the work folder is reused (the script can be rerun after a stop)."""
    return (run / f"ckpt-{steps:06d}" / "model.safetensors").is_file()


def _train_seconds(run: pathlib.Path, tokens_per_step: int) -> float:
    """Training time from the per-step throughput the run logged (evaluations excluded)."""
    total, seen = 0.0, 0
    for r in _records(run / "metrics.jsonl"):
        tokens = r.get("tokens", seen + tokens_per_step)
        total += (tokens - seen) / r["tokens_per_s"]
        seen = tokens
    return round(total, 1)


def _eval(model, tok, args) -> dict:
    from hyla.eval.needle import needle_eval
    from hyla.eval.perplexity import perplexity

    torch.manual_seed(0)
    ppl = perplexity(model, tok, seq_len=args.seq_len, max_tokens=args.eval_tokens)
    needle = needle_eval(model, tok, [args.needle_context], (0.25, 0.75), trials=args.trials)
    correct = sum(r["correct"] for r in needle)
    return {"ppl": round(ppl["perplexity"], 2), "ppl_tokens": ppl["tokens"],
            "needle": f"{correct}/{sum(r['trials'] for r in needle)}"}


def long_child(hf_dir: str, length: int, cap_gib: float, mode: str) -> None:
    """Subprocess: one stage-1 step (mode 'stream') or one materialised KL ('naive')."""
    cap = int(cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    tune_cpu_allocator()
    torch.set_num_threads(2)
    start = time.perf_counter()
    try:
        if mode == "stream":
            from hyla.train.distill import Distiller
            from hyla.train.distill.config import DistillConfig

            layers, kv = STUDENTS["GGGA"]
            d = Distiller(DistillConfig(teacher=hf_dir, recipe="plain-gla", layers=layers,
                                        student_kv_heads=kv,
                                        stage1_steps=1, stage2_steps=0, seq_len=256,
                                        stage1_seq_len=length, batch_size=1,
                                        optimizer="adamw", out=tempfile.mkdtemp()))
            start = time.perf_counter()
            rec = d.train_step()  # stage 1: stage1_steps=1
            extra = {"loss": rec["loss"], "layers": rec["layers"]}
        else:
            from hyla.ops.streamkl import attention_kl

            q = torch.randn(1, length, 6, 64, requires_grad=True)
            k = torch.randn(1, length, 2, 64, requires_grad=True)
            attention_kl(q.detach(), k.detach(), q, k, backend="naive").backward()
            extra = {}
        ok, error = True, None
    except (MemoryError, RuntimeError) as e:
        ok, error, extra = False, str(e).splitlines()[0][:200], {}
    print(json.dumps({"mode": mode, "ok": ok, "error": error, "seconds": time.perf_counter()
                      - start, "peak_rss_bytes": _peak_rss(), **extra}))


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it restarts at exec)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _run_child(hf_dir, length, cap_gib, mode, timeout=600) -> dict:
    cmd = [sys.executable, __file__, "--long-child", str(hf_dir), str(length), str(cap_gib), mode]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": f"not finished in {timeout} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"mode": mode, "ok": False, "error": (out.stderr.strip().splitlines() or
                                                     ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def plot(rows, curves, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["model"] for r in rows]
    a.barh(names, [r["ppl"] for r in rows], color="tab:blue")
    a.invert_yaxis()
    a.set_xlabel("validation perplexity (lower is better)")
    for i, r in enumerate(rows):
        a.text(r["ppl"], i, f" {r['ppl']:.1f}", va="center", fontsize=8)
    for label, (x, y) in curves.items():
        b.plot(x, y, label=label)
    b.set_xlabel("training tokens")
    b.set_ylabel("next-token cross-entropy (train batches)")
    b.set_title("stage 2 (after stage 1) vs from scratch")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:  # noqa: PLR0915 - one linear script
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-steps", type=int, default=120)
    p.add_argument("--stage1-steps", type=int, default=30)
    p.add_argument("--stage2-steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--needle-context", type=int, default=256)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--long-context", type=int, default=16384)
    p.add_argument("--cap-gib", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", default=None, help="folder for the runs (default: a temp dir)")
    p.add_argument("--long-child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.long_child:
        hf, length, cap, mode = args.long_child
        long_child(hf, int(length), float(cap), mode)
        return
    if args.quick:
        args.teacher_steps, args.stage1_steps, args.stage2_steps = 6, 3, 3
        args.eval_tokens, args.trials, args.long_context = 2048, 1, 2048
    tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    from hyla.cli import main as hyla
    from hyla.eval.memory import kv_cache_bytes, state_bytes
    from hyla.model import preset
    from hyla.model.formats.checkpoint import load_checkpoint
    from hyla.train.config import TrainConfig
    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig
    from hyla.train.distill.student import student_config
    from hyla.train.trainer import Trainer

    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="distill_small_"))
    teacher_cfg = dataclasses.replace(preset("small"), layers="A" * 8)
    student_cfgs = {n: student_config(teacher_cfg, lay, kv) for n, (lay, kv) in STUDENTS.items()}
    _register_presets(student_cfgs)
    common = dict(seq_len=args.seq_len, batch_size=args.batch_size, optimizer="adamw", lr=3e-3,
                  warmup_steps=5, eval_batches=4, seed=0)
    timings, rows, curves = {}, [], {}
    tps = args.seq_len * args.batch_size

    if not _done(work / "teacher", args.teacher_steps):
        Trainer(TrainConfig(preset="small-attention", steps=args.teacher_steps,
                            save_every=args.teacher_steps, out=str(work / "teacher"),
                            **common)).fit()
    timings["teacher"] = _train_seconds(work / "teacher", tps)
    if not (work / "hf" / "config.json").is_file():
        assert hyla(["export", "--format", "llama", str(work / "teacher"), str(work / "hf")]) == 0
    teacher, tok = load_checkpoint(work / "teacher")
    rows.append({"model": "teacher (8 x A)", "tokens": args.teacher_steps * args.seq_len
                 * args.batch_size, **_eval(teacher, tok, args),
                 "state_8k_bytes": kv_cache_bytes(teacher_cfg, 8192)})

    total = args.stage1_steps + args.stage2_steps
    for name, (layers, kv) in STUDENTS.items():
        out = work / f"student-{name}"
        if not _done(out, total):
            Distiller(DistillConfig(teacher=str(work / "hf"), recipe="plain-gla", layers=layers,
                                    student_kv_heads=kv,
                                    stage1_steps=args.stage1_steps,
                                    stage2_steps=args.stage2_steps, save_every=total,
                                    out=str(out), stage1_lr=1e-3, **common)).fit()
        timings[f"distill-{name}"] = _train_seconds(out, tps)
        state = state_bytes(student_cfgs[name], 8192)["total"]
        for stage, path in (("stage 1", out / "stage1"), ("stage 2", out)):
            model, _ = load_checkpoint(path)
            rows.append({"model": f"{layers} kv={kv or 6} after {stage}",
                         "tokens": (args.stage1_steps if stage == "stage 1" else total)
                         * args.seq_len * args.batch_size, **_eval(model, tok, args),
                         "state_8k_bytes": state})
        recs = [r for r in _records(out / "metrics.jsonl") if r["stage"] == 2]
        curves[f"{name} distilled (stage 2 CE)"] = (
            [(args.stage1_steps + i + 1) * tps for i in range(len(recs))], [r["ce"] for r in recs])

        scratch = work / f"scratch-{name}"
        scratch.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "teacher" / "tokenizer.json", scratch / "tokenizer.json")
        if not _done(scratch, total):
            Trainer(TrainConfig(preset=f"scratch-{name}", steps=total, save_every=total,
                                out=str(scratch), **common)).fit()
        timings[f"scratch-{name}"] = _train_seconds(scratch, tps)
        model, _ = load_checkpoint(scratch)
        rows.append({"model": f"{layers} kv={kv or 6} from scratch",
                     "tokens": total * tps, **_eval(model, tok, args), "state_8k_bytes": state})
        recs = _records(scratch / "metrics.jsonl")
        curves[f"{name} from scratch"] = ([r["tokens"] for r in recs], [r["loss"] for r in recs])

    kv_bytes = kv_cache_bytes(teacher_cfg, 8192)
    for r in rows:
        r["vs_teacher_kv"] = f"{kv_bytes / r['state_8k_bytes']:.1f}x less"
    long_rows = [_run_child(work / "hf", args.long_context, args.cap_gib, m)
                 for m in ("stream", "naive")]
    materialised = 1 * 6 * args.long_context ** 2 * 4  # one [B, H, T, T] fp32 score matrix
    print_table("distillation of an all-attention small teacher (validation perplexity, "
                "passkey hits, state per sequence at 8K, bf16 KV)", rows)
    print_table(f"one stage-1 step at {args.long_context:,} tokens under a {args.cap_gib:g} GiB "
                f"address-space cap (one fp32 T x T score matrix: {materialised / 2**30:.1f} "
                f"GiB)", [{k: v for k, v in r.items() if k != "layers"} for r in long_rows])
    name = "distill_small_quick" if args.quick else "distill_small"
    path = write_results(name, rows, long_context=long_rows, timings_s=timings,
                         materialised_score_matrix_bytes=materialised, teacher_kv_8k=kv_bytes,
                         settings={k: v for k, v in vars(args).items() if k != "long_child"},
                         curves={k: {"tokens": x, "loss": y} for k, (x, y) in curves.items()})
    plot(rows, curves, RESULTS_DIR / f"{name}.png")
    print(f"wrote {path} and {RESULTS_DIR / (name + '.png')}; runs in {work}")


if __name__ == "__main__":
    main()
