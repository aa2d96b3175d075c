"""What every benchmark shares: its command line, the machine and its load, timing (medians of
repeats, alternating rounds for side-by-side ratios), a progress line, tables, the results
file and the README row.

A benchmark is a module of this folder whose docstring's first line is its claim and which
defines ``main(run)``; it may define ``add_args(parser)`` for its own options (other modules
here are shared helpers). Run it as ``python -m benchmarks run NAME [options]``. Every one
also takes ``--quick`` (a small, fast version), ``--repeats N``, ``--rounds N``, ``--threads
N`` and ``--out DIR`` (where its results file goes; default ``benchmarks/results``).

Example:
    >>> run = Run("demo", [])
    >>> t = run.median(lambda: sum(range(1000)), repeats=3)
    >>> ratios({"a": 2.0, "b": 1.0}, "a")
    {'a': 1.0, 'b': 2.0}
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from hyla.perf import RESULTS_DIR, print_table, time_fn, write_results

HERE = pathlib.Path(__file__).resolve().parent
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The CPU features the kernels pick by (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in CPU_FLAGS if f in have]


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages: other jobs on a shared machine move every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def ratios(values: dict[str, float], base: str) -> dict[str, float]:
    """Each value over ``values[base]``: with times, how many times slower than the base;
    with throughputs, how many times faster."""
    return {k: v / values[base] for k, v in values.items()}


class Run:
    """One run of a benchmark: its options (``run.args``), timing helpers and its outputs."""

    def __init__(self, name: str, argv: list[str], add_args: Callable | None = None,
                 description: str = ""):
        parser = argparse.ArgumentParser(prog=f"python -m benchmarks run {name}",
                                         description=description)
        parser.add_argument("--quick", action="store_true",
                            help="a small, fast version (its results file ends in _quick)")
        parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
        parser.add_argument("--rounds", type=int, default=3,
                            help="alternating rounds of side-by-side comparisons (median)")
        parser.add_argument("--threads", type=int, default=None,
                            help="torch threads (default: torch's)")
        parser.add_argument("--out", default=None,
                            help="folder of the results file (default: benchmarks/results)")
        if add_args is not None:
            add_args(parser)
        self.name, self.argv, self.args = name, argv, parser.parse_args(argv)
        self.started = time.perf_counter()
        if self.args.threads:
            import torch

            torch.set_num_threads(self.args.threads)

    def progress(self, text: str) -> None:
        """One line on stderr with the time since the start: long runs say where they are."""
        print(f"[{self.name} {time.perf_counter() - self.started:7.1f}s] {text}",
              file=sys.stderr, flush=True)

    def median(self, fn: Callable[[], Any], *, repeats: int | None = None,
               warmup: int = 1) -> float:
        """Median seconds of ``fn()`` over ``repeats`` (default ``--repeats``) runs."""
        return time_fn(fn, repeats=repeats or self.args.repeats, warmup=warmup)

    def rounds(self, cases: dict[str, Callable[[], Any]],
               rounds: int | None = None) -> dict[str, list[Any]]:
        """Run every case once a round, the order reversed every other round (so a drifting
        machine favours none), ``rounds`` (default ``--rounds``) times; each case's results
        in round order. A case returning None is timed: its seconds are recorded."""
        names = list(cases)
        out: dict[str, list[Any]] = {n: [] for n in names}
        for r in range(rounds or self.args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                self.progress(f"round {r + 1}: {n}")
                start = time.perf_counter()
                value = cases[n]()
                out[n].append(time.perf_counter() - start if value is None else value)
        return out

    def side_by_side(self, cases: dict[str, Callable[[], Any]], base: str | None = None,
                     rounds: int | None = None) -> dict[str, dict[str, float]]:
        """:meth:`rounds`, reduced to each case's median seconds (or value) and its ratio to
        ``base`` (default: the first case)."""
        runs = self.rounds(cases, rounds)
        med = {n: statistics.median(v) for n, v in runs.items()}
        rel = ratios(med, base or next(iter(cases)))
        return {n: {"median": med[n], "vs_base": rel[n]} for n in cases}

    def table(self, title: str, rows: list[dict]) -> None:
        print_table(title, rows)

    def save(self, rows: list[dict], *, name: str | None = None, summary: str = "",
             **extra: Any) -> pathlib.Path:
        """``results/<name>.json`` (default: the benchmark's, ``_quick`` with ``--quick``)
        with the machine, its CPU flags and load, the command, ``summary`` (the README
        row's text) and ``extra``."""
        name = name or (f"{self.name}_quick" if self.args.quick else self.name)
        command = " ".join(["python -m benchmarks run", self.name, *self.argv])
        path = write_results(name, rows, results_dir=self.args.out, benchmark=self.name,
                             cpu_flags=cpu_flags(), load_average=load_average(), command=command,
                             seconds=round(time.perf_counter() - self.started, 1),
                             summary=summary, **extra)
        self.progress(f"wrote {path}")
        return path


def names() -> list[str]:
    """Every benchmark in this folder: the modules that define ``main(run)``."""
    return sorted(p.stem for p in HERE.glob("*.py")
                  if "\ndef main(run" in p.read_text(encoding="utf-8"))


def claim(name: str) -> str:
    """A benchmark's claim: its docstring's first line (read, not imported: cheap)."""
    import ast

    doc = ast.get_docstring(ast.parse((HERE / f"{name}.py").read_text(encoding="utf-8")))
    return (doc or "").strip().splitlines()[0] if doc else ""


def run(name: str, argv: list[str]) -> None:
    """Import ``benchmarks.<name>`` and call its ``main(Run)`` with ``argv``."""
    if name not in names():
        raise SystemExit(f"no benchmark {name!r}: `python -m benchmarks list` names them")
    from hyla.perf import tune_cpu_allocator

    tune_cpu_allocator()    # every figure is measured with it (docs/results.md says why)
    module = importlib.import_module(f"benchmarks.{name}")
    doc = (module.__doc__ or "").strip()
    module.main(Run(name, argv, getattr(module, "add_args", None), doc.splitlines()[0]
                    if doc else ""))


def readme_rows() -> list[str]:
    """One markdown row a results file that has a summary: claim, figures and machine,
    command. ``python -m benchmarks rows`` prints them for docs/results.md."""
    import json

    rows = []
    for path in sorted(RESULTS_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not data.get("summary"):
            continue
        m = data.get("machine", {})
        where = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, load "
                 f"{(data.get('load_average') or ['?'])[0]}, {data.get('date', '')[:10]}")
        bench = data.get("benchmark", path.stem)
        rows.append(f"| {claim(bench) if bench in names() else path.stem} | "
                    f"{data['summary']} ({where}) | `{data.get('command', '')}` |")
    return rows
