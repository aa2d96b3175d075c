"""``hyla <command>``: builds the parser from the command-group modules and runs a command.

Each group module registers its commands (``COMMANDS``: name -> a function that adds the
sub-parser) and imports only :mod:`hyla.cli.common` and library packages, never another
command module:

- :mod:`hyla.cli.memory`: ``memory``, ``info``
- :mod:`hyla.cli.serve`: ``generate``, ``serve``
- :mod:`hyla.cli.train`: ``quickstart``, ``train``, ``plot``, ``tokenizer train``
- :mod:`hyla.cli.eval`: ``eval recall|needle|ppl``
- :mod:`hyla.cli.bench`: ``bench muon-comm``
- :mod:`hyla.cli.simulate`: ``simulate``, ``profile``, ``kv-table``
- :mod:`hyla.cli.distill`: ``distill``, ``export``
- :mod:`hyla.cli.cluster`: ``cluster``, and ``serve --role prefill|decode|router``

Example:
    $ hyla memory --preset laplace-3b --context 8K --budget-gib 80
    $ hyla generate --preset debug --prompt "Hello" --max-tokens 32 --seed 0
    $ hyla eval recall --preset quick --out benchmarks/results/recall_quick
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from hyla.cli import bench, cluster, distill, memory, serve, simulate, train
from hyla.cli import eval as evaluate
from hyla.cli.common import ArgumentError, Parser
from hyla.perf import tune_cpu_allocator

GROUPS = (memory, serve, train, evaluate, bench, simulate, distill, cluster)
# The order ``hyla --help`` lists the commands in.
ORDER = ("memory", "generate", "quickstart", "info", "bench", "simulate", "profile", "kv-table",
         "distill", "export", "eval", "serve", "train", "plot", "tokenizer", "cluster")


def build_parser() -> argparse.ArgumentParser:
    """The ``hyla`` argument parser (one sub-command per package entry point)."""
    adders = {name: add for group in GROUPS for name, add in group.COMMANDS.items()}
    assert sorted(adders) == sorted(ORDER), "a command is missing from ORDER or from a group"
    parser = Parser(prog="hyla", description="Hybrid linear-attention language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in ORDER:
        adders[name](sub)
    cluster.add_role_options(sub.choices["serve"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hyla`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> import contextlib, io, json
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     status = main(["memory", "--preset", "debug", "--context", "1K", "--json"])
        >>> status, json.loads(out.getvalue())["context"]
        (0, 1024)
    """
    err = Console(stderr=True)
    tune_cpu_allocator()  # a CLI run owns its process: keep freed memory for reuse
    try:
        args = build_parser().parse_args(argv)
        return args.func(args, Console())
    except (ArgumentError, ValueError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    except ModuleNotFoundError as e:  # an optional extra the command needs
        err.print("[red]error:[/] " + escape(f"{e}: this command needs an optional extra, e.g. "
                                             "pip install -e '.[serve]' (serving, cluster, "
                                             "simulate) or '.[hf]'"))
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130

