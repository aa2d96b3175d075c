"""Distil SmolLM2-135M-Instruct into windowed G, D and K students at equal tokens (issue 35).

Three students of the 30-layer teacher with the same 7 softmax attention layers (4, 7, 8, 17,
18, 20, 23: what ``--layers auto:7`` keeps on SmolLM2) and the other 23 layers linearised
attention of one kind: the teacher's q/k/v/o, an exact 64-token window + 4 sinks, and a
recurrent branch for the rest,

- ``G``: GLA over Hedgehog feature maps, normalised (a decayed average of values);
- ``D``: the gated delta rule over L2-normalised feature maps, one decay a head;
- ``K``: the same with one decay a feature channel (Kimi's KDA gate).

Each run is one :class:`~hyla.train.distill.Distiller` with every setting passed explicitly
(the defaults of ``hyla distill`` are not read): stage 1 trains the new parameters against the
teacher's attention outputs, stage 2 is vocabulary KL + cross-entropy with LoRA rank 8 on
q/k/v/o, both on blocks of 1,024 tokens, batch 1. Afterwards the teacher and each student are
scored on the same held-out text (perplexity over 1,024-token windows): the stdlib corpus's
validation split (code, not trained on) and the software licences of
``/usr/share/common-licenses`` (English prose). Tokens/s of each stage: the median over its
steps (``metrics.jsonl``). Runs one after another in one process, 1 thread by default.

    nice -n 10 python benchmarks/distill_mixers.py                      # 20 + 20 steps each
    python benchmarks/distill_mixers.py --steps1 2 --steps2 2 --mixers D   # a smoke run

Writes ``benchmarks/results/distill_mixers.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ATTENTION_LAYERS = (4, 7, 8, 17, 18, 20, 23)
N_LAYERS = 30
LICENSES = pathlib.Path("/usr/share/common-licenses")
PROSE = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD")


def pattern(letter: str) -> str:
    """The 30-letter layer pattern: ``A`` at :data:`ATTENTION_LAYERS`, ``letter`` elsewhere."""
    return "".join("A" if i in ATTENTION_LAYERS else letter for i in range(N_LAYERS))


def settings(args) -> dict:
    """Every DistillConfig setting a run uses (no default is read)."""
    return dict(window=64, sinks=4, lora_rank=8, lora_alpha=16.0, lr=1e-3, warmup_steps=5,
                seq_len=1024, stage1_seq_len=1024, batch_size=1,
                stage1_steps=args.steps1, stage2_steps=args.steps2,
                optimizer="muon", muon_lr=0.02, stage1_lr=3e-3, stage1_muon_lr=0.02,
                attn_kl_weight=1.0, kl_weight=1.0, ce_weight=1.0, temperature=1.0,
                vocab_chunk=1024, decay_fraction=0.2, clip=1.0, weight_decay=0.0,
                autocast="off", activation_checkpointing=False, shuffle_buffer=16,
                eval_every=0, eval_batches=1, save_every=100000, keep_last=1,
                report_tokens=0, report_trials=2, full_report=False, seed=0,
                precision="fp32", data=None, eval_data=None, student_kv_heads=None)


def teacher_checkpoint(work: pathlib.Path) -> pathlib.Path:
    """The SmolLM2 GGUF (``hyla.model.names``: ``smollm2``) converted once to a hyla
    checkpoint, so each run loads it fast."""
    target = work / "teacher"
    if not (target / "model.safetensors").exists():
        from hyla.model.formats.checkpoint import save_checkpoint
        from hyla.model.load import load_model

        model, tok = load_model("smollm2")
        save_checkpoint(model, target, tok)
    return target


def prose_dir(work: pathlib.Path) -> pathlib.Path | None:
    """Held-out English prose: licence texts, one file each (None where there are none)."""
    files = [LICENSES / n for n in PROSE if (LICENSES / n).is_file()]
    if not files:
        return None
    out = work / "prose"
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        (out / f"{f.name}.txt").write_text(f.read_text(encoding="utf-8", errors="replace"))
    return out


def heldout_ppl(model, tokenizer, sets: dict, tokens: int) -> dict:
    from hyla.eval.perplexity import perplexity

    out = {}
    for name, path in sets.items():
        r = perplexity(model, tokenizer, path, seq_len=1024, max_tokens=tokens, batch_size=1)
        out[name] = {"perplexity": r["perplexity"], "tokens": r["tokens"]}
    return out


def stage_rates(metrics: pathlib.Path, tokens_per_step: int) -> dict:
    """Per stage: steps, median tokens/s and summed step seconds, from ``metrics.jsonl``."""
    import statistics

    stages: dict[str, list[float]] = {}
    for line in metrics.open(encoding="utf-8"):
        r = json.loads(line)
        if "stage" in r and "tokens_per_s" in r:
            stages.setdefault(str(r["stage"]), []).append(r["tokens_per_s"])
    return {s: {"steps": len(v), "tokens_per_s_median": statistics.median(v),
                "seconds": sum(tokens_per_step / x for x in v)} for s, v in stages.items()}


def run_one(letter: str, teacher: pathlib.Path, work: pathlib.Path, args, sets: dict) -> dict:
    import torch

    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig

    out = work / f"student_{letter}"
    shutil.rmtree(out, ignore_errors=True)
    kw = settings(args)
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    d = Distiller(DistillConfig(teacher=str(teacher), layers=pattern(letter), out=str(out), **kw))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    d.fit(progress=False)
    train = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    with torch.no_grad():
        ppl = heldout_ppl(d.model.eval(), d.tokenizer, sets, args.eval_tokens)
    row = {"layers": d.model.cfg.layers, "kinds": sorted({type(b.mixer).__name__
                                                           for b in d.model.blocks}),
           "heldout": ppl, "stages": stage_rates(out / "metrics.jsonl", kw["seq_len"]),
           "setup_seconds": setup, "train_seconds": train,
           "tokens_seen": kw["seq_len"] * (args.steps1 + args.steps2),
           "parameters": d.model.num_parameters(),
           "final_loss": [json.loads(x) for x in (out / "metrics.jsonl").open()][-1].get("loss"),
           "load_average_1min": load}
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    del d
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps1", type=int, default=20, help="stage-1 steps a run "
                   "(default: %(default)s)")
    p.add_argument("--steps2", type=int, default=20, help="stage-2 steps a run "
                   "(default: %(default)s)")
    p.add_argument("--mixers", default="GDK", help="the linear layer letters to compare, "
                   "any of G, D, K (default: %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens a set "
                   "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: "
                   "%(default)s)")
    p.add_argument("--work", default="/tmp/hyla_distill_mixers", help="where runs and the "
                   "converted teacher go (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep each student's run directory "
                   "(default: removed after scoring)")
    p.add_argument("--out", default=str(RESULTS / "distill_mixers.json"), help="the JSON "
                   "written (default: benchmarks/results/distill_mixers.json)")
    args = p.parse_args(argv)
    if not args.mixers or set(args.mixers) - set("GDK"):
        p.error(f"--mixers must be letters of G, D, K, got {args.mixers!r}")
    if args.steps1 < 1 or args.steps2 < 1 or args.eval_tokens < 1024:
        p.error("--steps1 and --steps2 must be >= 1 and --eval-tokens >= 1024")
    import torch

    torch.set_num_threads(args.threads)
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    teacher_dir = teacher_checkpoint(work)
    sets = {"stdlib validation (code)": None}
    prose = prose_dir(work)
    if prose is not None:
        sets["licences (prose)"] = str(prose)
    rows = {}
    for letter in args.mixers:
        rows[letter] = run_one(letter, teacher_dir, work, args, sets)
        print(f"{letter}: {json.dumps(rows[letter]['heldout'])}", flush=True)
    from hyla.model.load import load_model

    teacher, tok = load_model(str(teacher_dir))
    with torch.no_grad():
        teacher_ppl = heldout_ppl(teacher.eval(), tok, sets, args.eval_tokens)
    result = {"benchmark": "distill_mixers", "teacher": "SmolLM2-135M-Instruct GGUF (smollm2)",
              "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "threads": args.threads, "torch": torch.__version__,
              "attention_layers": list(ATTENTION_LAYERS),
              "settings": settings(args) | {"layers": "A at attention_layers, the letter "
                                                      "elsewhere"},
              "heldout_sets": {k: "stdlib corpus validation split" if v is None else
                               "/usr/share/common-licenses texts" for k, v in sets.items()},
              "teacher_heldout": teacher_ppl, "students": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def print_table(result: dict) -> None:
    sets = list(result["teacher_heldout"])
    head = "".join(f" {s[:26]:>26}" for s in sets)
    print(f"{'model':<8}{head} {'s1 tok/s':>9} {'s2 tok/s':>9} {'train min':>9} {'load':>9}")
    t = result["teacher_heldout"]
    print(f"{'teacher':<8}" + "".join(f" {t[s]['perplexity']:26.2f}" for s in sets))
    for letter, r in result["students"].items():
        ppl = {s: r["heldout"][s]["perplexity"] for s in sets}
        cells = "".join(f" {ppl[s]:17.2f} ({ppl[s] / t[s]['perplexity']:5.2f}x)" for s in sets)
        st = r["stages"]
        print(f"{letter:<8}{cells} {st.get('1', {}).get('tokens_per_s_median', 0):9.1f} "
              f"{st.get('2', {}).get('tokens_per_s_median', 0):9.1f} "
              f"{r['train_seconds'] / 60:9.1f} "
              f"{'/'.join(f'{x:.1f}' for x in r['load_average_1min']):>9}")


if __name__ == "__main__":
    main()
