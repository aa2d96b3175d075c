"""A shared host CPU for the simulator: ``cores`` shared fairly by every runnable job.

Where the simulated instances are processes on one machine (the live CPU cluster), their
engine steps and the serving path's work (HTTP, router, client) compete for the same cores.
:class:`HostCPU` is a fluid processor-sharing server: with ``n`` runnable jobs each
progresses at ``min(1, cores / n)`` CPU-seconds per second.
"""

from __future__ import annotations

import simpy


class HostCPU:
    """Processor sharing of ``cores`` among jobs; ``work(s)`` is an event that fires when
    ``s`` CPU-seconds of work are done.

    Example:
        >>> env = simpy.Environment()
        >>> cpu = HostCPU(env, cores=1)
        >>> a, b = cpu.work(1.0), cpu.work(1.0)
        >>> env.run(until=a)
        >>> env.now          # two jobs on one core: each runs at half speed
        2.0
    """

    def __init__(self, env: simpy.Environment, cores: float):
        if cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.env, self.cores = env, cores
        self.jobs: dict[simpy.Event, float] = {}     # event -> CPU-seconds left
        self.last = env.now
        self.version = 0
        self.busy_core_s = 0.0

    def rate(self) -> float:
        """CPU-seconds per second each runnable job gets now."""
        return min(1.0, self.cores / len(self.jobs)) if self.jobs else 1.0

    def work(self, seconds: float) -> simpy.Event:
        self._advance()
        ev = self.env.event()
        self.jobs[ev] = max(0.0, seconds)
        self._reschedule()
        return ev

    def _advance(self) -> None:
        dt = self.env.now - self.last
        if dt > 0 and self.jobs:
            r = self.rate()
            self.busy_core_s += dt * r * len(self.jobs)
            for ev in self.jobs:
                self.jobs[ev] -= dt * r
        self.last = self.env.now

    def _reschedule(self) -> None:
        for ev in [ev for ev, left in self.jobs.items() if left <= 1e-12]:
            del self.jobs[ev]
            ev.succeed()
        self.version += 1
        if self.jobs:
            self.env.process(self._next_completion(self.version,
                                                   min(self.jobs.values()) / self.rate()))

    def _next_completion(self, version: int, wait: float):
        yield self.env.timeout(wait)
        if version == self.version:         # nothing arrived or left meanwhile
            self._advance()
            self._reschedule()
