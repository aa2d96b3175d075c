"""Plots and files for the recall results (MQAR and text): accuracy vs load and vs state bytes.

Each curve's legend states the state it recalls from: one size for a fixed state, the
range over the test lengths for a growing one (attention keys and values).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

MARKERS = {"GG": "o", "GA": "s", "AA": "^", "DD": "D", "DA": "v", "KK": "P", "KA": "X"}


def _by_mixer(records: Sequence[dict]) -> dict[str, list[dict]]:
    """One curve per mixer (and per kind of context, for text recall)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        key = r["mixer"] + (f" ({r['context']} context)" if "context" in r else "")
        groups.setdefault(key, []).append(r)
    return groups


def _kb(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 10 * 1024 else f"{n / 1024:.1f} KiB"


def state_label(rows: Sequence[dict]) -> str:
    """The state of a curve: one size when it is fixed, the range when it grows.

    Example:
        >>> state_label([{"state_bytes": 17920}, {"state_bytes": 17920}])
        'state 18 KiB'
        >>> state_label([{"state_bytes": 4096}, {"state_bytes": 65536}])
        'state 4.0 KiB-64 KiB'
    """
    sizes = [r["state_bytes"] for r in rows if "state_bytes" in r]
    if not sizes:
        return "state ?"
    lo, hi = min(sizes), max(sizes)
    return f"state {_kb(lo)}" if lo == hi else f"state {_kb(lo)}-{_kb(hi)}"


def curve_label(key: str, rows: Sequence[dict]) -> str:
    """Legend text: the mixer, what it is, its learning rate (synthetic), its state."""
    first = rows[0]
    parts = [first.get("description", key) if "context" in first else
             f"{key}: {first.get('description', key)}"]
    if "lr" in first:
        parts.append(f"lr {first['lr']:g}")
    parts.append(state_label(rows))
    return f"{parts[0]} ({', '.join(parts[1:])})"


def plot_recall(records: Sequence[dict], out_dir: str | pathlib.Path,
                title: str = "MQAR") -> list[pathlib.Path]:
    """Write ``accuracy_vs_pairs.png`` and ``accuracy_vs_state.png``; one line per mixer.

    ``records`` are the best-lr records (see :func:`hyla.eval.recall.best_records`).

    Example:
        >>> import tempfile
        >>> rec = [{"mixer": "AA", "description": "attention only", "lr": 1e-3, "seq_len": 64,
        ...         "num_kv_pairs": 4, "accuracy": 1.0, "state_bytes": 65536}]
        >>> [p.name for p in plot_recall(rec, tempfile.mkdtemp())]
        ['accuracy_vs_pairs.png', 'accuracy_vs_state.png']
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, xlabel, name in (("num_kv_pairs", "key-value pairs (load)", "accuracy_vs_pairs"),
                              ("state_bytes", "state per sequence (bytes)",
                               "accuracy_vs_state")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for layers, rows in _by_mixer(records).items():
            rows = sorted(rows, key=lambda r: (r[key], r["seq_len"]))
            ax.plot([r[key] for r in rows], [r["accuracy"] for r in rows],
                    marker=MARKERS.get(layers, "x"),
                    ls="--" if rows[0].get("context") == "fixed" else "-",
                    label=curve_label(layers, rows))
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy on queries")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_recall(records: Sequence[dict], out_dir: str | pathlib.Path, **meta) -> pathlib.Path:
    """Write ``results.json`` (the list of records) and ``run.json`` (``meta``); return the first.

    Example:
        >>> import tempfile
        >>> write_recall([{"mixer": "AA"}], tempfile.mkdtemp(), seconds=1.0).name
        'results.json'
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(list(records), indent=2) + "\n", encoding="utf-8")
    (out / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n",
                                  encoding="utf-8")
    return path
