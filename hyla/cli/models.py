"""``hyla models``: the model names ``--checkpoint`` takes (models that arrive as Python
packages), with their size, where each comes from and whether it is installed.

Example:
    $ hyla models
    $ hyla models --json
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from hyla.cli.common import format_bytes


def add_models(sub) -> argparse.ArgumentParser:
    """Register ``hyla models`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("models", help="the model names --checkpoint takes, and whether each "
                                      "is installed")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.set_defaults(func=cmd_models)
    return p


COMMANDS = {"models": add_models}


def cmd_models(args: argparse.Namespace, out: Console) -> int:
    from hyla.model.names import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="Models by name (--checkpoint NAME)")
    for col, justify in (("name", "left"), ("params", "right"), ("size", "right"),
                         ("source (pip)", "left"), ("present", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "present")
    for r in rows:
        names = r["name"] + "".join(f"\n[dim]{a}[/]" for a in r["aliases"])
        present = "[green]yes[/]" if r["present"] else f"[yellow]no[/]: {r['install']}"
        table.add_row(names, r["params"], f"{format_bytes(r['size_bytes'])}\n"
                      f"[dim]{r['format']}[/]", r["source"], present)
    out.print(table)
    out.print("Any other source works too: a local directory or .gguf file, or a Hugging Face "
              "hub id (org/name).")
    return 0
