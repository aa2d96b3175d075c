"""Loss curves of a run, from its metrics.jsonl."""

from __future__ import annotations

import json
import pathlib


def plot_metrics(run_dir, out=None) -> pathlib.Path:
    """Write ``loss.png`` (training loss by step, validation loss where measured).

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\\n')
        >>> plot_metrics(d).name
        'loss.png'
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = pathlib.Path(run_dir)
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: expected the --out directory of hyla train")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} is empty: the run has not finished a step yet")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    target = pathlib.Path(out) if out else run / "loss.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
