"""``hyla memory`` (per-sequence state vs an all-attention KV cache; with ``--train``, the
bytes a rank holds to train the model, FSDP against replication) and ``hyla info``
(versions, device, measured matmul peak).

Example:
    $ hyla memory --preset laplace-3b --context 8K --budget-gib 80
    $ hyla memory --preset laplace-3b --context 8192 --json
    $ hyla memory --checkpoint path/to/Qwen3-Next-80B-A3B --context 128K   # config.json only
    $ hyla memory --checkpoint path/to/config.json --context 32K
    $ hyla memory --preset laplace-3b --train --world-size 8 --seq-len 4096 --dtype bf16
    $ hyla info
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hyla.cli.common import (
    DEFAULT_BUDGET_GIB,
    PRESETS_HELP,
    format_bytes,
    memory_table,
    published_line,
)


def add_memory(sub) -> argparse.ArgumentParser:
    """Register ``hyla memory`` on the ``hyla`` sub-parser set."""
    from hyla.eval.memory import parse_context

    def context(value: str) -> int:
        try:
            return parse_context(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p = sub.add_parser("memory", help="per-sequence state of a hybrid vs an all-attention KV cache")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help=PRESETS_HELP)
    which.add_argument("--checkpoint", metavar="SOURCE",
                       help="a model directory (hyla, transformers, fla), its config.json, a "
                            ".gguf file or a model name (hyla models): only the config (a "
                            "GGUF's metadata) is read, the model is sized on the meta device")
    p.add_argument("--context", type=context, help="tokens, e.g. 8192 or 8K (required "
                   "unless --train)")
    p.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET_GIB,
                   help=f"memory for weights + states (default {DEFAULT_BUDGET_GIB:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    t = p.add_argument_group("training memory (--train)")
    t.add_argument("--train", action="store_true",
                   help="bytes a rank for parameters, gradients, optimizer state and "
                        "activations, fsdp vs replicate")
    t.add_argument("--world-size", type=int, help="ranks (default 8)")
    t.add_argument("--seq-len", type=context, help="tokens a sequence (default 2048)")
    t.add_argument("--batch-size", type=int, help="sequences a rank a micro-batch (default 1)")
    t.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="training precision (default fp32): bf16 = autocast activations and "
                        "bf16 all-gathers; master weights, gradients and states stay fp32")
    t.add_argument("--optimizer", choices=("muon", "adamw"), help="default muon")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="count activations with per-block recomputation")
    p.set_defaults(func=cmd_memory)
    return p


def add_info(sub) -> argparse.ArgumentParser:
    """Register ``hyla info`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("info", help="versions, device, measured matmul peak")
    p.set_defaults(func=cmd_info)
    return p


COMMANDS = {"memory": add_memory, "info": add_info}


_TRAIN_FLAGS = ("world_size", "seq_len", "batch_size", "dtype", "optimizer",
                "activation_checkpointing")


def cmd_memory(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import memory_report

    if args.train:
        return _cmd_train_memory(args, out)
    given = [f"--{k.replace('_', '-')}" for k in _TRAIN_FLAGS
             if getattr(args, k, None) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)} only go with --train")
    if args.context is None:
        raise ValueError("--context is required (tokens, e.g. 8192 or 8K), unless --train")
    if args.checkpoint is not None:
        from hyla.model.sizing import read_config

        cfg = read_config(args.checkpoint)
        report = memory_report(cfg, args.context, budget_gib=args.budget_gib,
                               model=_name(args.checkpoint, cfg))
    else:
        report = memory_report(args.preset, args.context, budget_gib=args.budget_gib)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    table = memory_table(report)
    table.title = f"Per-sequence memory of {report['model'] or 'config'} at " \
                  f"{report['context']:,} tokens"
    if report["moe_layers"] or report["attention_active_params"] != report["attention_params"]:
        table.add_row("active parameters a token", f"{report['active_params'] / 1e6:,.1f}M",
                      f"{report['attention_active_params'] / 1e6:,.1f}M")
    if report["bounded_state_bytes"] != report["state_bytes"]:
        # a context shorter than a window: its ring is allocated whole, filled in part
        table.add_row(f"per sequence, {report['windowed_layers']} window rings filled to "
                      f"the context", format_bytes(report["bounded_state_bytes"]), "-")
    out.print(table)
    line = published_line(report)
    if line:
        out.print(line)
    return 0


def _cmd_train_memory(args: argparse.Namespace, out: Console) -> int:
    from hyla.cli.common import format_bytes
    from hyla.eval.train_memory import train_memory_report

    if args.context is not None:
        raise ValueError("--context sizes per-sequence state: with --train give --seq-len")
    for flag, value in (("--world-size", args.world_size), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.checkpoint is not None:
        from hyla.model.sizing import read_config

        cfg = read_config(args.checkpoint)
        model = _name(args.checkpoint, cfg)
    else:
        cfg, model = args.preset, args.preset
    report = train_memory_report(
        cfg, world_size=args.world_size or 8, seq_len=args.seq_len or 2048,
        batch_size=args.batch_size or 1, precision=args.dtype or "fp32",
        optimizer=args.optimizer or "muon",
        activation_checkpointing=args.activation_checkpointing, model=model)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    r, s = report, report["strategies"]
    table = Table(title=f"Training memory a rank: {r['model'] or 'config'} "
                        f"({r['params'] / 1e9:,.2f}B parameters), {r['world_size']} ranks, "
                        f"{r['batch_size']} x {r['seq_len']:,} tokens, {r['precision']}")
    table.add_column("")
    for name in ("fsdp", "replicate"):
        table.add_column(name, justify="right")
    ckpt = "checkpointed" if r["activation_checkpointing"] else "no checkpointing"
    muon = "Muon momentum (rows sharded) + " if r["optimizer"] == "muon" else ""
    rows = (("parameters (fp32)", "params"), ("gradients (fp32)", "grads"),
            (f"optimizer: {muon}AdamW moments", "optimizer"),
            ("all-gathered while computing (see below)", "transient"),
            (f"activations ({ckpt})", "activations"), ("total", "total"),
            ("sent a step (one micro-batch)", "comm_bytes"))
    for label, key in rows:
        table.add_row(label, *(format_bytes(s[n][key]) for n in ("fsdp", "replicate")))
    out.print(table)
    act = r["activation_detail"]
    out.print(f"all-gathered (fsdp): the root's {r['root_params'] / 1e6:,.0f}M parameters "
              f"(embedding, final norm, head: kept from forward to backward) and two blocks' "
              f"(computing + prefetched, up to {r['largest_block_params'] / 1e6:,.0f}M "
              f"each), with one block's and the root's fp32 gradients before their "
              f"reduce-scatter")
    out.print(f"activations: what autograd saves for backward, traced at this batch "
              f"(blocks {format_bytes(sum(act['blocks']))}, head "
              f"{format_bytes(act['head'])}, autocast weight copies "
              f"{format_bytes(act['weight_copies'])}) + the logits' fp32 gradient "
              f"{format_bytes(act['logits_grad'])}; checkpointed: block inputs + one block's "
              f"recompute + head = {format_bytes(act['checkpointed'])}")
    return 0


def _name(source: str, cfg) -> str:
    """What a sized model is called: its directory's name (a config file's own name unless
    it is the directory's ``config.json``), and its family."""
    import pathlib

    path = pathlib.Path(source).resolve()
    name = path.name
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    return f"{name} ({cfg.family})" if cfg.family else name


def cmd_info(args: argparse.Namespace, out: Console) -> int:
    import torch

    from hyla.perf import machine_info, matmul_peak_flops

    info = machine_info()
    cuda = info["cuda_device"] is not None
    device = "cuda" if cuda else "cpu"
    table = Table(title="hyla info")
    table.add_column("")
    table.add_column("")
    from hyla import __version__

    table.add_row("hyla", __version__)
    for key, value in info.items():
        table.add_row(key, str(value))
    table.add_row("device", device)
    # Small sizes on CPU: bf16 matmul is slow on CPUs without native bf16 units.
    for dtype, size in ((torch.float32, 4096 if cuda else 1024),
                        (torch.bfloat16, 4096 if cuda else 512)):
        flops = matmul_peak_flops(dtype, size=size, repeats=3, device=device)
        table.add_row(f"matmul peak {str(dtype).removeprefix('torch.')} ({size}^3)",
                      f"{flops / 1e9:,.1f} GFLOP/s")
    out.print(table)
    return 0
