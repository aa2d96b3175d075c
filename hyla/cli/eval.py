"""``hyla eval recall|needle|ppl``: thin maps onto hyla.eval.

Example:
    $ hyla eval recall --preset quick --out benchmarks/results/recall_quick
    $ hyla eval needle --checkpoint runs/quickstart --context 1K,4K
    $ hyla eval ppl --checkpoint runs/quickstart --json
    $ hyla eval harness --checkpoint model.gguf --tasks my_task --include-path tasks/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from rich.console import Console
from rich.table import Table

from hyla.cli.common import SOURCE_HELP, Parser, positive, torch_threads


def add_eval(sub) -> argparse.ArgumentParser:
    """Register ``hyla eval recall|needle|ppl`` on the ``hyla`` sub-parser set."""
    group = sub.add_parser("eval", help="evaluations: recall (MQAR), needle, perplexity, "
                                        "lm-evaluation-harness")
    evals = group.add_subparsers(dest="eval_command", required=True, parser_class=Parser)
    p = evals.add_parser("recall", help="train GLA / hybrid / attention models on MQAR, "
                                        "plot accuracy vs load and vs state bytes")
    p.add_argument("--preset", default="quick", choices=["quick", "zoology"],
                   help="quick: minutes on a CPU; zoology: the paper's sweep (GPU)")
    p.add_argument("--out", default="recall_results", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate-normalizer", type=float, default=None,
                   help="GLA forget-gate normaliser (default: the preset's, 16)")
    # Small models: one thread measured fastest on a shared 2-core machine.
    p.add_argument("--threads", type=positive, default=1, help="torch CPU threads")
    p.set_defaults(func=cmd_eval_recall)

    p = evals.add_parser("needle", help="passkey retrieval by context length and depth")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--context", default="1K,2K,4K", help="comma-separated lengths, e.g. 1K,8K")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for needle.json and needle.png "
                   "(default: the checkpoint directory, or needle-NAME for other sources)")
    p.set_defaults(func=cmd_needle)

    p = evals.add_parser("ppl", help="validation perplexity of a checkpoint")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--data", default=None, help="text source (default: stdlib validation split)")
    p.add_argument("--seq-len", "--window", dest="seq_len", type=int, default=512,
                   help="window length: tokens are scored in non-overlapping windows")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ppl)

    p = evals.add_parser("harness", help="EleutherAI lm-evaluation-harness tasks, in process "
                                         "(needs the eval extra: pip install 'hyla[eval]')")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", default=None,
                   help="folder of task YAML files (local tasks, local data)")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=positive, default=8)
    p.add_argument("--out", default=None, help="folder for lm-eval's results.json")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_harness)
    return group


COMMANDS = {"eval": add_eval}


def cmd_eval_recall(args: argparse.Namespace, out: Console) -> int:
    import time

    from hyla.eval.recall import best_records, recall_preset, run_recall
    from hyla.eval.recall_plot import plot_recall, write_recall
    from hyla.perf import machine_info, print_table

    p = recall_preset(args.preset)
    if args.gate_normalizer is not None:
        p = dataclasses.replace(p, gate_logit_normalizer=args.gate_normalizer)
    runs = len(p.mixers) * len(p.lrs)
    out.print(f"MQAR [bold]{p.name}[/]: mixers {', '.join(p.mixers)} x lrs "
              f"{', '.join(f'{lr:g}' for lr in p.lrs)} ({runs} trainings of "
              f"{p.train_steps} steps), seed {args.seed}")
    start = time.perf_counter()
    with torch_threads(args.threads):
        records = run_recall(p, seed=args.seed, progress=lambda line: out.print(line))
    seconds = time.perf_counter() - start
    best = best_records(records)
    write_recall(records, args.out, preset=dataclasses.asdict(p), seed=args.seed,
                 seconds=round(seconds, 1), machine=machine_info())
    plot_recall(best, args.out, title=f"MQAR ({p.name}), best lr per mixer, seed {args.seed}")
    rows = [{k: r[k] for k in ("mixer", "seq_len", "num_kv_pairs", "accuracy", "state_bytes",
                               "lr", "params")} for r in best]
    print_table(f"MQAR recall ({p.name}, best lr per mixer)", rows, console=out)
    out.print(f"{seconds:.0f} s; wrote {args.out}/results.json, accuracy_vs_pairs.png, "
              f"accuracy_vs_state.png")
    return 0


def cmd_needle(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import parse_context
    from hyla.eval.needle import needle_eval, plot_needle
    from hyla.model.load import load_model as load_source
    from hyla.model.load import model_name

    contexts = [parse_context(c) for c in args.context.split(",") if c.strip()]
    try:
        depths = [float(d) for d in args.depths.split(",")]
    except ValueError as e:
        raise ValueError(f"depths must be comma-separated numbers in [0, 1], got "
                         f"{args.depths!r}") from e
    model, tok = load_source(args.checkpoint)
    records = needle_eval(model, tok, contexts, depths, trials=args.trials, seed=args.seed)
    table = Table(title=f"passkey retrieval accuracy ({args.trials} trials a cell)")
    table.add_column("depth")
    for c in contexts:
        table.add_column(f"{c:,}", justify="right")
    for d in depths:
        table.add_row(f"{d:.0%}", *[f"{r['accuracy']:.2f}" for c in contexts for r in records
                                    if r["context"] == c and r["depth"] == d])
    out.print(table)
    folder = pathlib.Path(args.out) if args.out else pathlib.Path(args.checkpoint)
    if not args.out and not folder.is_dir():       # a .gguf file or a hub id
        folder = pathlib.Path(f"needle-{model_name(args.checkpoint)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "needle.json").write_text(json.dumps(records, indent=1) + "\n")
    plot_needle(records, folder / "needle.png")
    out.print(f"wrote {folder / 'needle.json'} and {folder / 'needle.png'}")
    return 0


def cmd_ppl(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.perplexity import perplexity
    from hyla.model.load import load_model as load_source

    model, tok = load_source(args.checkpoint)
    r = perplexity(model, tok, args.data, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(r))
    else:
        table = Table(title=f"perplexity of {args.checkpoint}")
        for col in ("perplexity", "loss (nats/token)", "tokens scored", "windows", "window"):
            table.add_column(col, justify="right")
        table.add_row(f"{r['perplexity']:.2f}", f"{r['loss']:.4f}", f"{r['tokens']:,}",
                      str(r["windows"]), str(r["seq_len"]))
        out.print(table)
    return 0


def cmd_harness(args: argparse.Namespace, out: Console) -> int:
    try:
        from hyla.eval.harness import run_harness
    except ImportError as e:
        raise ValueError(str(e)) from None
    from lm_eval.utils import make_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    with torch_threads(args.threads):
        try:
            results = run_harness(args.checkpoint, tasks, include_path=args.include_path,
                                  limit=limit, batch_size=args.batch_size,
                                  num_fewshot=args.num_fewshot, out=args.out)
        except (RuntimeError, FileNotFoundError) as e:  # no network, a missing data file
            raise ValueError(f"{e} (a task's data_files are relative to the current "
                             "directory)" if isinstance(e, FileNotFoundError) else str(e)
                             ) from None
    print(make_table(results))
    if args.out:
        out.print(f"wrote {pathlib.Path(args.out) / 'results.json'}")
    return 0
