"""``hyla memory`` (per-sequence state vs an all-attention KV cache) and ``hyla info``
(versions, device, measured matmul peak).

Example:
    $ hyla memory --preset laplace-3b --context 8K --budget-gib 80
    $ hyla memory --preset laplace-3b --context 8192 --json
    $ hyla memory --checkpoint path/to/Qwen3-Next-80B-A3B --context 128K   # config.json only
    $ hyla memory --checkpoint path/to/config.json --context 32K
    $ hyla info
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hyla.cli.common import DEFAULT_BUDGET_GIB, format_bytes, memory_table, published_line


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
    which.add_argument("--preset", help="debug, small, laplace-3b")
    which.add_argument("--checkpoint", metavar="DIR|CONFIG.json",
                       help="a model directory (hyla, transformers, fla) or its config.json: "
                            "only the config is read, the model is sized on the meta device")
    p.add_argument("--context", required=True, type=context, help="tokens, e.g. 8192 or 8K")
    p.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET_GIB,
                   help=f"memory for weights + states (default {DEFAULT_BUDGET_GIB:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_memory)
    return p


def add_info(sub) -> argparse.ArgumentParser:
    """Register ``hyla info`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("info", help="versions, device, measured matmul peak")
    p.set_defaults(func=cmd_info)
    return p


COMMANDS = {"memory": add_memory, "info": add_info}


def cmd_memory(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import memory_report

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
    if report["windowed_layers"]:
        table.add_row(f"per sequence, {report['windowed_layers']} window layers keeping "
                      f"their window only", format_bytes(report["bounded_state_bytes"]), "-")
    out.print(table)
    line = published_line(report)
    if line:
        out.print(line)
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
