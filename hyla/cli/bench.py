"""``hyla bench``: measurements behind the README's claims, as commands."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from hyla.cli.common import PRESETS_HELP, Parser, format_bytes, positive


def add_bench(sub) -> argparse.ArgumentParser:
    """Register ``hyla bench ...`` on the ``hyla`` sub-parser set."""
    bench = sub.add_parser("bench", help="measurements behind the README's claims")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=Parser)
    p = bench_sub.add_parser("muon-comm", help="distributed Muon traffic: all_gather vs "
                             "all_to_all, W local gloo processes")
    p.add_argument("--world", required=True, type=positive, help="processes (ranks), >= 2")
    p.add_argument("--preset", default="laplace-3b", help=PRESETS_HELP)
    p.add_argument("--width-divisor", type=positive, default=None,
                   help="divide the widths by this (default 16 for laplace-3b, else 1)")
    p.add_argument("--steps", type=positive, default=1, help="optimizer steps to measure")
    p.add_argument("--ns-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Newton-Schulz precision (fp32: bf16 matmuls are slow on most CPUs)")
    p.add_argument("--comm-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the gathered / exchanged matrices on the wire")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_muon_comm)
    return bench


COMMANDS = {"bench": add_bench}


def cmd_bench_muon_comm(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.optim.bench import run_muon_comm

    r = run_muon_comm(args.world, args.preset, width_divisor=args.width_divisor,
                      steps=args.steps, ns_dtype=args.ns_dtype, comm_dtype=args.comm_dtype)
    if args.json:
        sys.stdout.write(json.dumps(r) + "\n")
        return 0
    full = r["full_scale"]
    table = Table(title=f"Distributed Muon, {r['world']} ranks, {r['preset']}, {r['comm_dtype']} "
                        f"exchanges: per rank per step (run at width /{r['width_divisor']})")
    for col in ("strategy", "bytes (run)", "NS FLOP (run)", "bytes (full)", "NS FLOP (full)"):
        table.add_column(col, justify="right")
    for name, s in r["strategies"].items():
        f = full["strategies"][name]
        table.add_row(name, format_bytes(s["bytes_per_rank"]), f"{s['ns_flops_per_rank']:.3g}",
                      format_bytes(f["bytes_per_rank"]), f"{f['ns_flops_per_rank']:.3g}")
    out.print(table)
    out.print(f"all_gather / all_to_all bytes: measured {r['measured_ratio']:.3g}x, full width "
              f"{full['ratio']:.3g}x, analytic W/2 = {r['analytic_ratio']:.3g}x; measured "
              f"counts {'match' if r['matches_plan'] else 'DO NOT match'} the plan.")
    return 0
