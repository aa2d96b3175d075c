"""Windowed G, D and K students of SmolLM2, distilled at equal tokens, keep its perplexity alike.

The 7 attention layers ``auto:7`` keeps (4, 7, 8, 17, 18, 20, 23) and 23 linearised ones (the
teacher's q/k/v/o, a 64-token window + 4 sinks and a GLA, gated-delta or KDA branch), every
setting explicit (``--steps`` + ``--steps`` of 1,024 tokens, fp32, LoRA 8), 1 thread unless
``--threads``; held-out code and prose perplexity (8,192 tokens) and tokens/s of each stage.
``--quick``: the first mixer, 1 + 1 steps, 1,024 tokens.
"""

import os
import pathlib
import shutil
import statistics
import time

import torch

from benchmarks.train_common import heldout, jsonl, scores, smollm2

ATTENTION_LAYERS = (4, 7, 8, 17, 18, 20, 23)


def add_args(parser) -> None:
    parser.add_argument("--steps", type=int, default=10, help="steps of each stage")
    parser.add_argument("--mixers", default="GDK", help="linear layer letters, of G, D, K")
    parser.add_argument("--work", default="/tmp/hyla_distill_mixers", help="runs and teacher")


def settings(steps: int) -> dict:
    """Every DistillConfig setting a run uses (no default is read)."""
    return dict(window=64, sinks=4, lora_rank=8, lora_alpha=16.0, lr=1e-3, warmup_steps=5,
                seq_len=1024, stage1_seq_len=1024, batch_size=1, stage1_steps=steps,
                stage2_steps=steps, optimizer="muon", muon_lr=0.02, stage1_lr=3e-3,
                stage1_muon_lr=0.02, attn_kl_weight=1.0, kl_weight=1.0, ce_weight=1.0,
                temperature=1.0, vocab_chunk=1024, decay_fraction=0.2, clip=1.0,
                weight_decay=0.0, autocast="off", activation_checkpointing=False,
                shuffle_buffer=16, eval_every=0, eval_batches=1, save_every=100000, keep_last=1,
                report_tokens=0, report_trials=2, full_report=False, seed=0, precision="fp32",
                data=None, eval_data=None, student_kv_heads=None)


def student(letter, teacher, work, kw, sets, tokens) -> dict:
    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig

    out = work / f"student_{letter}"
    shutil.rmtree(out, ignore_errors=True)
    layers = "".join("A" if i in ATTENTION_LAYERS else letter for i in range(30))
    d = Distiller(DistillConfig(teacher=str(teacher), layers=layers, out=str(out), **kw))
    load, start = [os.getloadavg()[0]], time.perf_counter()
    d.fit(progress=False)
    train, rates = time.perf_counter() - start, {}
    for r in jsonl(out / "metrics.jsonl"):
        if "stage" in r and "tokens_per_s" in r:
            rates.setdefault(f"s{r['stage']} tok/s", []).append(r["tokens_per_s"])
    shutil.rmtree(out, ignore_errors=True)
    return {"model": letter, **scores(d.model, d.tokenizer, sets, tokens=tokens),
            **{k: statistics.median(v) for k, v in rates.items()}, "train min": train / 60,
            "load": [*load, os.getloadavg()[0]], "layers": d.model.cfg.layers}


def main(run) -> None:
    from hyla.model.load import load_model

    a = run.args
    steps, mixers, tokens = (1, a.mixers[:1], 1024) if a.quick else (a.steps, a.mixers, 8192)
    torch.set_num_threads(a.threads or 1)
    work = pathlib.Path(a.work)
    teacher_dir, kw, sets = smollm2(work), settings(steps), heldout(work)
    rows = []
    for letter in mixers:
        run.progress(f"student {letter}")
        rows.append(student(letter, teacher_dir, work, kw, sets, tokens))
    teacher, tok = load_model(str(teacher_dir))
    rows.insert(0, {"model": "teacher", **scores(teacher, tok, sets, tokens=tokens)})
    for r in rows[1:]:
        r |= {f"{k} vs teacher": r[k] / rows[0][k] for k in rows[0] if k.startswith("ppl_")}
    run.table("SmolLM2 students: held-out perplexity and tokens/s",
              [{k: v for k, v in r.items() if k not in ("layers", "load")}
               for r in rows])
    run.save(rows, attention_layers=ATTENTION_LAYERS, settings=kw, threads=a.threads or 1,
             heldout_tokens=tokens, summary="perplexity on " + " / ".join(sets) + ": " + ", ".join(
                 f"{r['model']} " + " / ".join(f"{r[f'ppl_{s}']:.2f}" for s in sets) for r in rows))
