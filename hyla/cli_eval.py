"""``hyla eval needle`` and ``hyla eval ppl``: thin maps onto hyla.eval."""

from __future__ import annotations

import argparse
import json
import pathlib

from rich.console import Console
from rich.table import Table


def add_checkpoint_evals(eval_sub) -> None:
    """Register ``needle`` and ``ppl`` on the ``hyla eval`` sub-parser set."""
    p = eval_sub.add_parser("needle", help="passkey retrieval by context length and depth")
    p.add_argument("--checkpoint", required=True, help="a checkpoint or training run directory")
    p.add_argument("--context", default="1K,2K,4K", help="comma-separated lengths, e.g. 1K,8K")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for needle.json and needle.png")
    p.set_defaults(func=cmd_needle)

    p = eval_sub.add_parser("ppl", help="validation perplexity of a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default=None, help="text source (default: stdlib validation split)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ppl)


def cmd_needle(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import parse_context
    from hyla.eval.needle import needle_eval, plot_needle
    from hyla.model.checkpoint import load_checkpoint

    contexts = [parse_context(c) for c in args.context.split(",") if c.strip()]
    try:
        depths = [float(d) for d in args.depths.split(",")]
    except ValueError as e:
        raise ValueError(f"depths must be comma-separated numbers in [0, 1], got "
                         f"{args.depths!r}") from e
    model, tok = load_checkpoint(args.checkpoint)
    records = needle_eval(model, tok, contexts, depths, trials=args.trials, seed=args.seed)
    table = Table(title=f"passkey retrieval accuracy ({args.trials} trials a cell)")
    table.add_column("depth")
    for c in contexts:
        table.add_column(f"{c:,}", justify="right")
    for d in depths:
        table.add_row(f"{d:.0%}", *[f"{r['accuracy']:.2f}" for c in contexts for r in records
                                    if r["context"] == c and r["depth"] == d])
    out.print(table)
    folder = pathlib.Path(args.out or args.checkpoint)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "needle.json").write_text(json.dumps(records, indent=1) + "\n")
    plot_needle(records, folder / "needle.png")
    out.print(f"wrote {folder / 'needle.json'} and {folder / 'needle.png'}")
    return 0


def cmd_ppl(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.perplexity import perplexity
    from hyla.model.checkpoint import load_checkpoint

    model, tok = load_checkpoint(args.checkpoint)
    r = perplexity(model, tok, args.data, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(r))
    else:
        out.print(f"perplexity [bold]{r['perplexity']:.2f}[/] (loss {r['loss']:.4f} nats/token) "
                  f"over {r['tokens']:,} predicted tokens in {r['windows']} windows of "
                  f"{r['seq_len']}")
    return 0
