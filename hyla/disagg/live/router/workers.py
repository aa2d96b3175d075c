"""What the router knows of one worker (prefill or decode), polled from its ``/health``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Worker:
    url: str
    role: str
    info: dict = field(default_factory=dict)
    healthy: bool = False
    error: str | None = "not polled yet"
    inflight: int = 0
    last_ok: float = 0.0
    queued_tokens: int = 0          # not tracked per worker: the policy picks by inflight
    slow_polls: int = 0             # health polls in a row that timed out

    @property
    def name(self) -> str:
        return self.url

    def view(self) -> dict:
        i = self.info
        return {"role": self.role, "address": self.url, "pid": i.get("pid"),
                "healthy": self.healthy, "health": "ok" if self.healthy else "down",
                "error": self.error, "inflight": self.inflight,
                "transfer_address": i.get("transfer_address"),
                "queue_s": i.get("queue_s"), "fingerprint": i.get("fingerprint")}
