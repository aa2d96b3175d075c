"""``hyla memory`` (per-sequence state vs an all-attention KV cache) and ``hyla info``
(versions, device, measured matmul peak).

Example:
    $ hyla memory --preset laplace-3b --context 8K --budget-gib 80
    $ hyla memory --preset laplace-3b --context 8192 --json
    $ hyla info
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hyla.cli.common import DEFAULT_BUDGET_GIB, memory_table, published_line


def add_memory(sub) -> argparse.ArgumentParser:
    """Register ``hyla memory`` on the ``hyla`` sub-parser set."""
    from hyla.eval.memory import parse_context

    def context(value: str) -> int:
        try:
            return parse_context(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p = sub.add_parser("memory", help="per-sequence state of a hybrid vs an all-attention KV cache")
    p.add_argument("--preset", required=True, help="debug, small, laplace-3b")
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

    report = memory_report(args.preset, args.context, budget_gib=args.budget_gib)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    out.print(memory_table(report))
    line = published_line(report)
    if line:
        out.print(line)
    return 0


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
