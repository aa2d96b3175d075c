"""Plots and files for the MQAR recall results: accuracy vs load and accuracy vs state bytes."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

MARKERS = {"GG": "o", "GA": "s", "AA": "^", "DD": "D", "DA": "v"}


def _by_mixer(records: Sequence[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["mixer"], []).append(r)
    return groups


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
                    label=f"{layers}: {rows[0].get('description', layers)} "
                          f"(lr {rows[0]['lr']:g})")
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
