"""Where a server's start-up time goes, from the process's own start (the interpreter and
its imports included), phase by phase: what ``hyla serve`` logs once it is ready.

Example:
    >>> clock = StartupClock()
    >>> clock.mark("load")
    >>> clock.describe().startswith("ready in ")
    True
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``), or None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # field 22, after the command name (which may hold spaces, in parentheses)
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Phases as they end (:meth:`mark`); the first runs from the process's start where that
    is known (else from the clock's creation, named so)."""

    def __init__(self, first: str = "Python and imports"):
        age = process_age_s()
        self._last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []
        if age is not None:
            self.phases.append((first, age))

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def describe(self) -> str:
        total = sum(s for _, s in self.phases)
        return f"ready in {total:.1f} s: " + ", ".join(
            f"{name} {s:.2f} s" for name, s in self.phases)
