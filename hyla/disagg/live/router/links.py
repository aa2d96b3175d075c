"""The router's book of prefill -> decode paths: one measured
:class:`~hyla.disagg.policy.link.LinkEstimate` per path, the bytes queued on each, the size
of a state by its tokens, and what every remote request taught (exactly one verdict each).

A request the policy sends remote opens a :class:`Shipment`; how it ended is one of:

- the prefill worker answered with the transfer's figures: the decode worker acknowledged
  the state (:meth:`Shipment.acked`: a sample of throughput and latency);
- no acknowledgement by the deadline, on either side (:meth:`Shipment.lost`: a failure
  of the path, which opens its breaker after a few in a row);
- anything else (the receiver rejected a corrupt state, a worker died, the client left):
  :meth:`Shipment.void`, no verdict on the link.

Example:
    >>> from hyla.disagg.policy.link import LinkConfig
    >>> book = LinkBook(LinkConfig(initial_gbps=10.0), clock=lambda: 5.0)
    >>> s = book.open("http://p:1", "http://d:2", tokens=100, probe=False)
    >>> s.acked({"bytes": 20_000, "transfer_s": 0.05, "wire_s": 0.04})
    >>> v = book.view()["http://p:1 -> http://d:2"]
    >>> v["state"], v["transfers"], book.size.predict(100)
    ('ok', 1, 20000)
"""

from __future__ import annotations

import time

from hyla.disagg.policy.link import DOWN, LinkConfig, LinkEstimate, StateSize


class Shipment:
    """One remote request's transfer on a path, until its verdict."""

    def __init__(self, book: LinkBook, key: tuple[str, str], tokens: int, nbytes: int,
                 probe: bool):
        self.book, self.key, self.tokens, self.nbytes, self.probe = book, key, tokens, \
            nbytes, probe
        self.done = False
        book.backlog[key] = book.backlog.get(key, 0) + nbytes

    @property
    def link(self) -> LinkEstimate:
        return self.book.links[self.key]

    def _close(self) -> bool:
        if self.done:
            return False
        self.done = True
        self.book.backlog[self.key] = max(0, self.book.backlog.get(self.key, 0) - self.nbytes)
        return True

    def acked(self, figures: dict) -> None:
        """The prefill worker's answer: ``bytes``, ``transfer_s`` (first byte to the
        decode side's acknowledgement), ``wire_s``."""
        if not self._close():
            return
        nbytes, secs = int(figures.get("bytes") or 0), float(figures.get("transfer_s") or 0)
        wire = figures.get("wire_s")
        self.link.observe(nbytes, secs, wire if isinstance(wire, int | float) else None,
                          now=self.book.now(), probe=self.probe)
        self.book.size.observe(self.tokens, nbytes)

    def lost(self, seconds: float) -> None:
        """Not acknowledged within ``seconds``: the path failed."""
        if self._close():
            self.link.failure(self.nbytes, seconds, now=self.book.now(), probe=self.probe)

    def void(self) -> None:
        """Ended without a verdict on the link."""
        if self._close() and self.probe:
            self.link.probe_abandoned()


class LinkBook:
    """Estimates per ``(prefill URL, decode URL)`` path, made on first use from ``cfg``."""

    def __init__(self, cfg: LinkConfig, clock=time.monotonic):
        self.cfg, self.clock, self.t0 = cfg, clock, clock()
        self.links: dict[tuple[str, str], LinkEstimate] = {}
        self.backlog: dict[tuple[str, str], int] = {}
        self.size = StateSize()

    def now(self) -> float:
        return self.clock() - self.t0

    def link(self, prefill: str, decode: str) -> LinkEstimate:
        key = (prefill, decode)
        if key not in self.links:
            self.links[key] = LinkEstimate(self.cfg)
        return self.links[key]

    def open(self, prefill: str, decode: str, tokens: int, probe: bool) -> Shipment:
        self.link(prefill, decode)
        nbytes = self.size.predict(tokens) or 0
        return Shipment(self, (prefill, decode), tokens, nbytes, probe)

    def capacity_gbps(self) -> float:
        """What the link is measured to carry (the best path's estimate; the prior before
        any transfer): the policy's utilisation is egress over this, not over the
        configured figure."""
        return max((link.gbps for link in self.links.values()), default=self.cfg.cap)

    def state_bytes(self, tokens: int) -> int | None:
        return self.size.predict(tokens)

    def view(self) -> dict:
        """``/cluster``'s ``links``: per path (``"PREFILL -> DECODE"``) its ``link``
        figures."""
        return {f"{p} -> {d}": {**link.view(), "queued_bytes": self.backlog.get((p, d), 0),
                                "deadline_s": round(link.deadline_s(
                                    self.size.predict(1024) or 0), 3)}
                for (p, d), link in self.links.items()}

    def degraded(self) -> dict[str, str]:
        """The paths not ``ok``: ``"PREFILL -> DECODE"`` to their state."""
        return {f"{p} -> {d}": link.state for (p, d), link in self.links.items()
                if link.state != "ok"}

    def metrics(self) -> list[str]:
        """Prometheus lines: estimate, latency floor and state (one gauge a state) per
        path."""
        out = []
        for (p, d), link in self.links.items():
            lbl = f'prefill="{p}",decode="{d}"'
            out.append(f"hyla_router_link_gbps_estimate{{{lbl}}} {link.gbps:.6g}")
            out.append(f"hyla_router_link_rtt_seconds{{{lbl}}} {link.rtt_s:.6g}")
            for st in ("ok", "degraded", DOWN):
                out.append(f'hyla_router_link_state{{{lbl},state="{st}"}} '
                           f"{int(link.state == st)}")
            out.append(f"hyla_router_link_failures_total{{{lbl}}} {link.failures}")
            out.append(f"hyla_router_link_probes_in_flight{{{lbl}}} {link.probes_in_flight}")
        return out
