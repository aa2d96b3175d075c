"""Options of one layer kind, read from a config's ``mixer_options`` / ``ffn_options``.

A layer kind whose shape needs more than :class:`~hyla.model.HylaConfig`'s common fields
declares an options dataclass; :func:`parse_options` builds it from the config's dict for
that kind, so a misspelt or mistyped option is a ValueError naming it, not a silent default.
"""

from __future__ import annotations

import dataclasses
import typing


def parse_options(options_class: type | None, values: dict | None, where: str):
    """``options_class(**values)``, with a ValueError naming ``where`` and the option for
    unknown names and values of the wrong type; None when the kind takes no options.

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Opts:
        ...     top_k: int = 2
        >>> parse_options(Opts, {"top_k": 4}, "moe").top_k
        4
        >>> parse_options(Opts, {"topk": 4}, "moe")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: moe: unknown option(s) ['topk']: expected some of ['top_k']
    """
    values = dict(values or {})
    if options_class is None:
        if values:
            raise ValueError(f"{where}: this layer kind takes no options, got {sorted(values)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(options_class)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}: expected some of "
                         f"{sorted(fields)}")
    missing = sorted(n for n, f in fields.items() if n not in values
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where}: missing required option(s) {missing}")
    hints = typing.get_type_hints(options_class)
    for name, value in values.items():
        if not _fits(value, hints[name]):
            raise ValueError(f"{where}: option {name}={value!r} must be {hints[name]}")
    try:
        return options_class(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _fits(value, hint) -> bool:
    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (list, tuple):
        return isinstance(value, list | tuple)
    return isinstance(value, hint)
