"""The request traces that ship with hyla (package data; see ``README.md`` beside this file
for their provenance and licence).

A trace is named (``azure-conv``, ``arxiv-summarization``) or given as a path to any CSV with
``num_prefill_tokens`` and ``num_decode_tokens`` columns (and ``arrived_at`` seconds, when it
has arrival times). Reading them needs only the standard library.

Example:
    >>> trace_path("azure-conv").name
    'azure_conv_2023.csv'
    >>> [t["name"] for t in list_traces()]
    ['azure-conv', 'arxiv-summarization']
"""

from __future__ import annotations

import csv
import functools
import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
TRACES = {  # built-in name -> (file, one line on what it is)
    "azure-conv": ("azure_conv_2023.csv", "Azure conversation, Nov 2023: 1 h of real arrivals"),
    "arxiv-summarization": ("arxiv_summarization_lengths.csv",
                            "arXiv summarisation: lengths only (Llama-2 tokens)"),
}


def trace_path(trace: str | os.PathLike) -> pathlib.Path:
    """The CSV of a built-in trace name, or ``trace`` itself when it is an existing file.

    Example:
        >>> trace_path("nope")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: trace 'nope' is neither a built-in trace (...) nor an existing file
    """
    if isinstance(trace, str) and trace in TRACES:
        return HERE / TRACES[trace][0]
    path = pathlib.Path(trace)
    if path.is_file():
        return path
    raise ValueError(f"trace {str(trace)!r} is neither a built-in trace "
                     f"({', '.join(TRACES)}) nor an existing file")


def list_traces() -> list[dict]:
    """The built-in traces: ``name``, ``file``, ``about``, ``requests``, ``arrivals`` (has
    arrival times), ``prompt_p50/p90/p99`` and ``output_p50/p90`` (tokens)."""
    return [_summary(name) for name in TRACES]


@functools.cache
def _summary(name: str) -> dict:
    file, about = TRACES[name]
    with (HERE / file).open(newline="") as f:
        rows = list(csv.DictReader(f))
    prompts = sorted(int(r["num_prefill_tokens"]) for r in rows)
    outputs = sorted(int(r["num_decode_tokens"]) for r in rows)

    def pct(xs: list[int], q: float) -> int:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"name": name, "file": file, "about": about, "requests": len(rows),
            "arrivals": "arrived_at" in rows[0],
            **{f"prompt_p{q}": pct(prompts, q / 100) for q in (50, 90, 99)},
            **{f"output_p{q}": pct(outputs, q / 100) for q in (50, 90)}}
