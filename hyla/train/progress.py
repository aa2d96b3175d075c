"""The progress display of a training run (one bar for every objective and stage)."""

from __future__ import annotations

import math


class ProgressDisplay:
    """A rich progress bar: label, step M/N, loss, tokens a second, learning rate, time left.

    Disabled (``enabled=False``: ``--no-progress``, ranks other than 0) it prints nothing.

    Example:
        >>> with ProgressDisplay(total=3, completed=0, enabled=False) as bar:
        ...     bar.update(1, {"loss": 2.5, "tokens_per_s": 100.0, "lr": 1e-3})
        >>> bar.completed
        1
    """

    def __init__(self, total: int, completed: int = 0, *, label: str = "step",
                 enabled: bool = True):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.completed = completed
        self._bar = Progress(TextColumn("{task.fields[label]}"), MofNCompleteColumn(),
                             BarColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
                             TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
                             TextColumn("lr {task.fields[lr]:.2e}"), TimeRemainingColumn(),
                             disable=not enabled)
        self._task = self._bar.add_task("train", total=total, completed=completed, label=label,
                                        loss=math.nan, tok_s=0.0, lr=0.0)

    def __enter__(self) -> ProgressDisplay:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def update(self, step: int, record: dict, label: str | None = None) -> None:
        """Show ``step`` done, with the ``loss``, ``tokens_per_s`` and ``lr`` of ``record``."""
        self.completed = step
        fields = {"loss": record.get("loss", math.nan),
                  "tok_s": record.get("tokens_per_s", 0.0), "lr": record.get("lr", 0.0)}
        if label is not None:
            fields["label"] = label
        self._bar.update(self._task, completed=step, **fields)
        if "val_loss" in record and not self._bar.disable:
            # evaluations stay on screen: one line each, every validation field
            shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items()
                              if k.startswith(("val_", "teacher_val_")) and
                              isinstance(v, float))
            self._bar.console.print(f"step {step}: {shown}")
