"""The ``hyla`` command: :mod:`hyla.cli.main` builds the parser from one module per command
group; :mod:`hyla.cli.common` holds what several commands share.

``from hyla.cli import main`` gives the entry point, :func:`hyla.cli.main.main`.
"""

from hyla.cli.main import main

__all__ = ["main"]
