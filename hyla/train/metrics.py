"""``metrics.jsonl``: one JSON object a training step, rewritten past a resumed checkpoint."""

from __future__ import annotations

import json
import pathlib


class MetricsLog:
    """Append-only per-step log of a run; ``enabled=False`` (ranks other than 0) writes nothing.

    Opening it at ``step`` (a resumed run) drops the lines of later steps, which the resumed
    run rewrites, so the log keeps one line a step.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> log = MetricsLog(path)
        >>> for step in (1, 2, 3):
        ...     log.write({"step": step, "loss": 1.0 / step})
        >>> _ = MetricsLog(path, step=2)  # resumed from the step-2 checkpoint
        >>> [r["step"] for r in MetricsLog.read(path)]
        [1, 2]
    """

    def __init__(self, path: pathlib.Path, step: int = 0, *, enabled: bool = True):
        self.path, self.enabled = pathlib.Path(path), enabled
        if enabled and self.path.is_file():
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln and json.loads(ln)["step"] <= step]
            self.path.write_text("".join(ln + "\n" for ln in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    @staticmethod
    def read(path: pathlib.Path) -> list[dict]:
        """Every record of a ``metrics.jsonl``, in order."""
        return [json.loads(ln) for ln in pathlib.Path(path).read_text().splitlines() if ln]
