"""``hyla <command>``: builds the parser from the command-group modules and runs a command.

Each group module registers its commands (``COMMANDS``: name -> a function that adds the
sub-parser) and imports only :mod:`hyla.cli.common` and library packages, never another
command module:

- :mod:`hyla.cli.memory`: ``memory``, ``info``
- :mod:`hyla.cli.serve`: ``generate``, ``serve``
- :mod:`hyla.cli.chat`: ``chat``
- :mod:`hyla.cli.models`: ``models``
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

from hyla.cli import bench, chat, cluster, distill, memory, models, serve, simulate, train
from hyla.cli import eval as evaluate
from hyla.cli.common import ArgumentError, HelpFormatter, Parser
from hyla.perf import tune_cpu_allocator

GROUPS = (memory, serve, chat, models, train, evaluate, bench, simulate, distill, cluster)
# The order ``hyla --help`` lists the commands in.
ORDER = ("quickstart", "chat", "generate", "serve", "models", "memory", "info", "simulate",
         "profile", "kv-table", "train", "plot", "tokenizer", "distill", "export", "eval",
         "bench", "cluster")


# The extra that brings a module a command may import (hyla[all] has them all).
EXTRAS = {"transformers": "hf", "gguf": "gguf", "accelerate": "gguf", "lm_eval": "eval",
          "openai": "serve", "triton": "gpu", "fla": "gpu"}


def build_parser() -> argparse.ArgumentParser:
    """The ``hyla`` argument parser (one sub-command per package entry point)."""
    adders = {name: add for group in GROUPS for name, add in group.COMMANDS.items()}
    assert sorted(adders) == sorted(ORDER), "a command is missing from ORDER or from a group"
    parser = Parser(prog="hyla", description="Train, distill, evaluate and serve hybrid "
                    "linear-attention language models.",
                    formatter_class=lambda prog: HelpFormatter(prog, max_help_position=18))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser,
                                metavar="command", title="commands (hyla command --help)")
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
    err = Console(stderr=True, soft_wrap=True)   # one line: a command in it stays whole
    tune_cpu_allocator()  # a CLI run owns its process: keep freed memory for reuse
    try:
        args = build_parser().parse_args(argv)
        from hyla.model.finite import allowing_nonfinite

        with allowing_nonfinite(getattr(args, "allow_nonfinite", False)):
            return args.func(args, Console())
    except (ArgumentError, ValueError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    except ModuleNotFoundError as e:  # an optional extra the command needs
        extra = EXTRAS.get((e.name or "").split(".")[0], "all")
        err.print("[red]error:[/] " + escape(f"{e}: this command needs an optional extra: "
                                             f"pip install 'hyla[{extra}]' (from a clone: "
                                             f"pip install -e '.[{extra}]')"))
        return 2
    except OSError as e:    # the machine's side: a full disk, a permission, a busy port
        said = e.strerror or str(e)
        where = f": {e.filename}" if e.filename and str(e.filename) not in said else ""
        err.print(f"[red]error:[/] {escape(said + where)}")
        return 1
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130

