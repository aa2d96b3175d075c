"""``hyla train``, ``hyla plot`` and ``hyla tokenizer train``: thin maps onto hyla.train."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from hyla.train.config import OPTIMIZERS, PRECISIONS, TrainConfig


def add_train_commands(sub) -> None:
    """Register the training commands on the ``hyla`` sub-parser set."""
    p = sub.add_parser("train", help="train a preset on the stdlib corpus or your data")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        elif field.name in ("optimizer", "precision"):
            choices = OPTIMIZERS if field.name == "optimizer" else PRECISIONS
            p.add_argument(flag, choices=choices, default=default)
        else:
            kind = type(default) if default is not None else str
            p.add_argument(flag, type=kind, default=default)
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot", help="write a run's loss curves as PNG")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, parser_class=p.__class__)
    t = tsub.add_parser("train", help="train a byte-level BPE on a corpus")
    t.add_argument("--data", default=None, help="corpus (default: the stdlib corpus)")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--documents", type=int, default=2000, help="documents to learn from")
    t.add_argument("--out", required=True, help="directory for tokenizer.json")
    t.set_defaults(func=cmd_tokenizer_train)


def cmd_train(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.trainer import Trainer

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    trainer = Trainer(cfg, resume=args.resume)
    out.print(f"training [bold]{trainer.cfg.preset}[/] "
              f"({trainer.model.num_parameters():,} parameters) -> {trainer.out}")
    record = trainer.fit(progress=not args.no_progress)
    out.print(f"step {record['step']}: validation loss {record.get('val_loss', float('nan')):.3f}"
              f"; checkpoint in {trainer.out}")
    return 0


def cmd_plot(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.plot import plot_metrics

    out.print(f"wrote {plot_metrics(args.run_dir)}")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace, out: Console) -> int:
    import pathlib

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
