"""``hyla train``, ``hyla plot`` and ``hyla tokenizer train``: thin maps onto hyla.train;
``hyla quickstart``: state accounting, a short training run, a sample.

Example:
    $ hyla quickstart
    $ hyla train --preset small --steps 200 --out runs/small
    $ hyla plot runs/small
    $ hyla tokenizer train --vocab-size 8192 --out runs/tok
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

from rich.console import Console

from hyla.cli.common import (
    DEFAULT_BUDGET_GIB,
    PRESETS_HELP,
    add_sampling,
    all_cores,
    finished_line,
    format_bytes,
    format_seconds,
    generate_text,
    memory_table,
    positive,
    published_line,
    refuse_existing_run,
    torch_threads,
    train_quickstart,
)
from hyla.train.config import (
    DEVICES,
    OPTIMIZERS,
    PLANNED_STRATEGIES,
    PRECISIONS,
    STRATEGIES,
    TrainConfig,
)


def add_quickstart(sub) -> argparse.ArgumentParser:
    """Register ``hyla quickstart`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("quickstart", help="state accounting, a short training run, a sample")
    p.add_argument("--preset", default="small", help=f"model size ({PRESETS_HELP})")
    p.add_argument("--steps", type=positive, default=120, help="optimizer steps")
    p.add_argument("--out", default="runs/quickstart",
                   help="run directory (checkpoints, metrics.jsonl, loss.png)")
    add_sampling(p, 48, all_cores(), threads_help="torch CPU threads for training and "
                 "sampling (default: every core, $OMP_NUM_THREADS if set: %(default)s here)")
    p.set_defaults(func=cmd_quickstart)
    return p


# Planned strategies (none left) parse, so that TrainConfig can say they are not built yet.
CHOICES = {"optimizer": OPTIMIZERS, "precision": PRECISIONS, "device": DEVICES,
           "strategy": STRATEGIES + PLANNED_STRATEGIES}


# What the multi-process flags mean (the others are TrainConfig's fields, shown with their
# defaults).
HELP = {
    "strategy": "under torchrun: fsdp (FSDP2 shards, sharded Muon, DCP checkpoints), diloco "
                "(replicas, outer Nesterov every --sync-every steps) or fomoe (diloco with each "
                "expert on --expert-replicas workers)",
    "sync_every": "diloco/fomoe: inner steps between outer syncs",
    "outer_lr": "diloco/fomoe: outer SGD learning rate on the averaged pseudo-gradient",
    "outer_momentum": "diloco/fomoe: outer Nesterov momentum (0: plain SGD)",
    "expert_replicas": "fomoe: workers holding each expert, 1..W (W is diloco)",
    "token_skipping": "fomoe: drop (token, expert) pairs routed to experts held elsewhere",
    "sync_timeout": "seconds a collective may wait before a silent rank is named",
    "device": "cpu, or cuda (each rank on cuda:LOCAL_RANK)",
    "preset": f"model size ({PRESETS_HELP})",
    # the single-process flags (a newcomer found "--layers LAYERS  layers": the name again)
    "layers": "the layer pattern instead of the preset's, one letter a layer (A attention, "
              "G GLA, D gated delta, K KDA, M MLA, S Mamba-2, C short conv, P parallel "
              "hybrid), e.g. GGGA",
    "init": "start from this model (a name, directory or .gguf): its config, weights and "
            "tokenizer replace the preset's",
    "data": "training text: a text file, a folder of text files, a .jsonl file (a text "
            "field) or a .parquet file (a text column); default: the embedded Python "
            "standard library source",
    "out": "the run's directory (checkpoints, metrics.jsonl, run.json, tokenizer.json); one "
           "that already holds a run is refused unless --resume",
    "steps": "optimizer steps",
    "seq_len": "tokens a training block",
    "batch_size": "blocks a micro-batch",
    "shuffle_buffer": "blocks mixed at once before batching (0: file order only)",
    "grad_accum": "micro-batches a step (gradients accumulated)",
    "optimizer": "muon (Muon on 2-D hidden weights, AdamW on the rest) or adamw",
    "lr": "AdamW's learning rate (Muon's AdamW-side parameters too)",
    "muon_lr": "Muon's learning rate",
    "muon_strategy": "multi-process runs: how the sharded Muon shares matrices",
    "weight_decay": "decoupled weight decay",
    "warmup_steps": "steps of linear warm-up",
    "decay_fraction": "the last fraction of steps that decays the rate to 0 "
                      "(warmup-stable-decay)",
    "clip": "gradient norm clipping (0: none)",
    "precision": "fp32, or bf16 (autocast: fast on GPUs and AMX CPUs, slow elsewhere)",
    "activation_checkpointing": "recompute each block's activations in backward (less "
                                "memory, more compute)",
    "offload_activations": "keep saved activations in CPU memory (GPU runs)",
    "save_every": "steps between checkpoints",
    "keep_last": "checkpoints kept (older ones are deleted)",
    "eval_every": "steps between validation passes (0: only at the end)",
    "eval_batches": "validation batches a pass",
    "seed": "random seed (weights, data order)",
    "vocab_size": "the BPE vocabulary trained for the run (not with --init)",
    "tokenizer_documents": "training documents the BPE learns from",
}


def add_train(sub) -> argparse.ArgumentParser:
    """Register ``hyla train`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("train", help="train a preset on the stdlib corpus or your data")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        text = f"{HELP.get(field.name, field.name.replace('_', ' '))} (default: {default})"
        if isinstance(default, bool):   # on by default: --no-<flag> turns it off
            p.add_argument(flag, action=argparse.BooleanOptionalAction if default
                           else "store_true", default=default, help=text)
        elif field.name in CHOICES:
            p.add_argument(flag, choices=CHOICES[field.name], default=default, help=text)
        else:
            kind = type(default) if default is not None else str
            p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (logs and CI); metrics.jsonl is written either way")
    p.set_defaults(func=cmd_train)
    return p


def add_plot(sub) -> argparse.ArgumentParser:
    """Register ``hyla plot`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("plot", help="write a run's loss curves as PNG")
    p.add_argument("run_dir", help="a training run's directory (its metrics.jsonl); the "
                   "plot is written there as loss.png")
    p.set_defaults(func=cmd_plot)
    return p


def add_tokenizer(sub) -> argparse.ArgumentParser:
    """Register ``hyla tokenizer train`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, parser_class=p.__class__)
    t = tsub.add_parser("train", help="train a byte-level BPE on a corpus")
    t.add_argument("--data", default=None, help="corpus (default: the stdlib corpus)")
    t.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    t.add_argument("--documents", type=int, default=2000, help="documents to learn from")
    t.add_argument("--out", required=True, help="directory for tokenizer.json")
    t.set_defaults(func=cmd_tokenizer_train)
    return p


COMMANDS = {"quickstart": add_quickstart, "train": add_train, "plot": add_plot,
            "tokenizer": add_tokenizer}


def serve_hint(checkpoint: str, name: str, port: int = 8000) -> str:
    """What to run to serve ``checkpoint`` and query it with curl and the openai client.

    Example:
        >>> "hyla serve --checkpoint runs/q" in serve_hint("runs/q", "q")
        True
    """
    base = f"http://127.0.0.1:{port}/v1"
    body = json.dumps({"model": name, "prompt": "def fibonacci(n):", "max_tokens": 32})
    return (f"Serve it (OpenAI-compatible API on 127.0.0.1:{port}):\n"
            f"  hyla serve --checkpoint {checkpoint}\n"
            f"Then, from another shell:\n"
            f"  curl {base}/completions -H 'Content-Type: application/json' -d '{body}'\n"
            f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}', "
            f"api_key='none'); print(c.completions.create(model='{name}', "
            f"prompt='def fibonacci(n):', max_tokens=32).choices[0].text)\"")


def cmd_quickstart(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import memory_report

    start = time.perf_counter()
    out.rule("hyla quickstart")
    # the preset it trains (a "small" line once described every run, debug's too)
    small = memory_report(args.preset, 8192, budget_gib=DEFAULT_BUDGET_GIB)
    out.print(f"Preset [bold]{args.preset}[/]: layers {small['layers']}, "
              f"{small['params']:,} parameters.")
    out.print(memory_table(small))
    big = memory_report("laplace-3b", 8192, budget_gib=DEFAULT_BUDGET_GIB)
    out.print(f"Preset [bold]laplace-3b[/] (all GLA, {big['params'] / 1e9:.2f}B parameters) at "
              f"8K tokens: {format_bytes(big['state_bytes'])} of state per sequence vs "
              f"{format_bytes(big['kv_bytes'])} of bf16 KV cache: {big['ratio']:.0f}x less.")
    line = published_line(big)
    if line:
        out.print(line)
    from hyla.model.formats.checkpoint import load_checkpoint

    ckpt = train_quickstart(out, preset=args.preset, steps=args.steps, out_dir=args.out,
                            threads=args.threads)
    model, tok = load_checkpoint(ckpt)
    prompt = "def fibonacci(n):\n    "
    with torch_threads(args.threads):
        text = generate_text(model, tok, prompt, args)
    out.print("A sampled completion of a Python prompt:")
    out.print(prompt + text, markup=False, highlight=False)
    out.print(serve_hint(ckpt, pathlib.Path(ckpt).resolve().name), markup=False,
              highlight=False, soft_wrap=True)     # no wrapping: the lines are to copy
    out.print("Chat with a real model: hyla chat --checkpoint smollm2 (hyla models)",
              markup=False, highlight=False, soft_wrap=True)
    out.print(f"[bold]hyla quickstart took {format_seconds(time.perf_counter() - start)}[/] "
              f"(loss curves: hyla plot {ckpt})")
    return 0


def cmd_train(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.trainer import Trainer

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    if not args.resume:
        refuse_existing_run(cfg.out, "train")
    trainer = Trainer(cfg, resume=args.resume)
    say = out.print if trainer.rank == 0 else (lambda *a, **k: None)   # torchrun: rank 0 talks
    parallel = (f", {trainer.world} ranks, {trainer.cfg.strategy}" if trainer.world > 1
                else "")
    say(f"training [bold]{trainer.cfg.preset}[/] "
        f"({trainer.model.num_parameters():,} parameters{parallel}) -> {trainer.out}")
    record = trainer.fit(progress=not args.no_progress)
    say(finished_line(record, trainer.out))
    return 0


def cmd_plot(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.plot import plot_metrics

    out.print(f"wrote {plot_metrics(args.run_dir)}")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace, out: Console) -> int:
    from hyla.data.corpus import iter_documents
    from hyla.data.tokenizer import train_bpe

    docs = iter_documents(args.data, "train")
    sample = (d for _, d in zip(range(args.documents), docs, strict=False))
    tok = train_bpe(sample, args.vocab_size)
    target = pathlib.Path(args.out)
    target.mkdir(parents=True, exist_ok=True)
    tok.save(target / "tokenizer.json")
    out.print(f"wrote {target / 'tokenizer.json'} ({tok.vocab_size:,} tokens)")
    return 0
