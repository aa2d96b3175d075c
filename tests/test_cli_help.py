"""Help on every flag: each option of each ``hyla`` command has a description, shows its
default, and lists its choices; every command's ``--help`` prints and exits 0."""

from __future__ import annotations

import argparse

import pytest

from hyla.cli.main import build_parser, main
from hyla.model.config import PRESETS


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of the parser and every sub-command under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def flags():
    """(command, action) of every argument but -h and the hidden ones."""
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if action.help is argparse.SUPPRESS:
                continue
            yield " ".join(path), action


def name(command: str, action: argparse.Action) -> str:
    return f"hyla {command} {'/'.join(action.option_strings) or action.dest}"


def rendered_help(parser_path: str, action: argparse.Action) -> str:
    """The help text of ``action`` as ``--help`` prints it (defaults filled in)."""
    parser = dict(parsers(build_parser()))[tuple(parser_path.split()) if parser_path else ()]
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def test_every_flag_has_help():
    missing = [name(c, a) for c, a in flags() if not (a.help or "").strip()]
    assert not missing, f"{len(missing)} flags without help: {missing}"


def test_no_help_only_repeats_the_flag_name():
    """A newcomer found about 20 of train's flags described by their own name ("--clip
    CLIP  clip (default: 1.0)")."""
    bare = []
    for command, action in flags():
        words = (action.help or "").split(" (default")[0].strip().lower()
        if action.option_strings and words in (action.dest.replace("_", " "),
                                               action.dest.replace("_", "-")):
            bare.append(name(command, action))
    assert not bare, f"{len(bare)} flags whose help is their name: {bare}"


def test_every_flag_with_a_default_shows_it():
    hidden = []
    for command, action in flags():
        default = action.default
        if (not action.option_strings or default is None or isinstance(default, bool)
                or default == "" or action.nargs == 0):
            continue
        if "default" not in rendered_help(command, action).lower():
            hidden.append(name(command, action))
    assert not hidden, f"flags whose help does not show the default: {hidden}"


def test_presets_are_listed():
    unlisted = [name(c, a) for c, a in flags() if "--preset" in a.option_strings
                and not a.choices and not all(p in a.help for p in ("debug", "small"))]
    assert not unlisted, unlisted
    # the commands that build any preset name every one of them
    for command, action in flags():
        if "--preset" in action.option_strings and command in ("quickstart", "generate",
                                                               "chat"):
            assert all(p in action.help for p in PRESETS), name(command, action)


def test_choices_show_in_help():
    parser = dict(parsers(build_parser()))[("serve",)]
    text = " ".join(parser.format_help().split())
    assert "--dtype {auto,float32,bfloat16}" in text
    assert "port to listen on (default: 8000)" in text


@pytest.mark.parametrize("command", [" ".join(p) for p, _ in parsers(build_parser())])
def test_help_of_every_command_exits_zero(command, capsys):
    assert main([*command.split(), "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hyla")
