"""What an ops backend is (a module of its own so that backends import it without importing
the registry in :mod:`hyla.ops.backends`, which loads the built-in ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backend:
    """A set of op implementations with hyla's signatures.

    ``supports(op, args, kwargs)`` returns None when the backend can run that call, else a
    short reason (used in the error when the backend is forced). Higher ``priority`` wins in
    ``auto`` selection.
    """

    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    supports: Callable[[str, tuple, dict], str | None] = lambda op, args, kwargs: None
    priority: int = 0
