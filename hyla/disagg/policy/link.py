"""What the router knows about a prefill -> decode link, measured: a running estimate of
its throughput and latency, a circuit breaker, and when to probe it. Pure Python, no torch.

Every completed transfer reports its bytes, its end-to-end time (first byte sent to the
decode side's acknowledgement of a verified, loaded state) and its time on the wire (the
receiver's first message to its last). From those, per path:

- ``rtt_s``: the floor of recent latency, the minimum over the last ``window`` transfers of
  end-to-end minus wire time (what a transfer costs besides its bytes);
- ``gbps``: an EWMA (weight ``alpha``) of the achieved time per bit, bits over the wire
  time (or, without one, over the time beyond that floor; averaging time, not rate, lets
  one slow transfer weigh as it should: a link 1000x slower than believed is seen after
  a transfer or two), never faster than ``cap_gbps`` (the configured ``--link-gbps``,
  which is also the estimate before any transfer and the sender's pacing cap);
- a transfer's expected time :meth:`LinkEstimate.transfer_s` = ``rtt_s`` + bytes (its own
  and those already queued on the path) over ``gbps``, and its deadline
  :meth:`LinkEstimate.deadline_s` = ``deadline_factor`` times that, within
  ``[min_deadline_s, max_deadline_s]``: seconds, not a flat 30 s.

A failed transfer (no acknowledgement by its deadline) counts against the path (an outage
says nothing of the link's speed once it is back); ``fail_threshold`` failures in a row open the
breaker (``state`` ``"down"``: nothing is shipped). While open, one probe at a time is let
through, the first ``probe_interval_s`` after opening, then at doubling intervals up to
``probe_interval_max_s``; a probe that succeeds closes it. While shipping is slower than
prefilling locally (the policy decides, :meth:`hyla.disagg.policy.prfaas.PrfaasRouter.
check_link`) the path is ``"degraded"``: a share ``probe_share`` of the requests it would
have shipped still go (and one every ``probe_interval_max_s`` at least), one at a time, so
the estimate follows a link that recovers.

Example (a fake clock: ``now`` is passed in):
    >>> link = LinkEstimate(LinkConfig(initial_gbps=10.0))
    >>> round(link.transfer_s(1_000_000), 4)              # the prior: 10 Gbps, no latency
    0.0008
    >>> for i in range(5):
    ...     link.observe(500_000, seconds=1.05, wire_s=1.0, now=float(i))   # 4 Mbit/s
    >>> round(link.gbps, 4), round(link.rtt_s, 2), round(link.transfer_s(500_000), 2)
    (0.0041, 0.05, 1.02)
    >>> for i in range(3):
    ...     link.failure(500_000, seconds=2.0, now=10.0 + i)
    >>> link.state, link.allow_probe(12.5), link.allow_probe(13.1)
    ('down', False, True)
    >>> link.start_probe(13.1)
    >>> link.observe(500_000, seconds=0.06, wire_s=0.01, now=13.2, probe=True)
    >>> link.state, link.probes_in_flight, round(link.gbps, 4)     # closed; still slow
    ('ok', 0, 0.0082)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

OK, DEGRADED, DOWN = "ok", "degraded", "down"


@dataclass(kw_only=True)
class LinkConfig:
    """Knobs of :class:`LinkEstimate` (seconds, Gbps). ``cap_gbps`` None: ``initial_gbps``.

    Example:
        >>> LinkConfig(initial_gbps=1.0).cap
        1.0
    """

    initial_gbps: float = 10.0
    cap_gbps: float | None = None
    alpha: float = 0.5
    window: int = 16
    fail_threshold: int = 3
    probe_interval_s: float = 1.0
    probe_interval_max_s: float = 8.0
    probe_share: float = 0.05
    deadline_factor: float = 4.0
    min_deadline_s: float = 1.0
    max_deadline_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("initial_gbps", "probe_interval_s", "deadline_factor", "min_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cap_gbps is not None and not self.cap_gbps > 0:
            raise ValueError(f"cap_gbps must be > 0 (or None), got {self.cap_gbps}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.window < 1 or self.fail_threshold < 1:
            raise ValueError(f"window and fail_threshold must be >= 1, got {self.window}, "
                             f"{self.fail_threshold}")
        if not 0 <= self.probe_share <= 1:
            raise ValueError(f"probe_share must be in [0, 1], got {self.probe_share}")
        if self.max_deadline_s < self.min_deadline_s:
            raise ValueError(f"max_deadline_s {self.max_deadline_s} < min_deadline_s "
                             f"{self.min_deadline_s}")

    @property
    def cap(self) -> float:
        return self.initial_gbps if self.cap_gbps is None else self.cap_gbps


class LinkEstimate:
    """One prefill -> decode path's estimate and breaker (see the module docstring)."""

    def __init__(self, cfg: LinkConfig | None = None):
        self.cfg = cfg or LinkConfig()
        self.gbps = min(self.cfg.initial_gbps, self.cfg.cap)
        self._rtts: deque[float] = deque(maxlen=self.cfg.window)
        self.consecutive_failures = 0
        self.transfers = self.failures = self.probes = 0
        self.last_transfer_s: float | None = None
        self.last_at: float | None = None
        self.open = False                  # the breaker
        self.slow = False                  # set by the policy: shipping is slower than local
        self.probes_in_flight = 0
        self._backoff = self.cfg.probe_interval_s
        self._next_probe = 0.0
        self._vetoed = 0
        self._last_probe = 0.0

    # -- measurements ------------------------------------------------------------------
    @property
    def rtt_s(self) -> float:
        """The latency floor: the least recent end-to-end time beyond the wire."""
        return min(self._rtts) if self._rtts else 0.0

    def observe(self, nbytes: int, seconds: float, wire_s: float | None = None,
                now: float = 0.0, probe: bool = False) -> None:
        """A transfer of ``nbytes`` acknowledged ``seconds`` after its first byte went out
        (``wire_s``: the receiver's first-to-last message time, if known)."""
        if nbytes < 0 or not seconds >= 0:
            raise ValueError(f"need nbytes >= 0 and seconds >= 0, got {nbytes}, {seconds}")
        serial_prior = nbytes * 8 / (self.gbps * 1e9)
        wire = wire_s if wire_s is not None and 0 <= wire_s <= seconds else None
        self._rtts.append(max(0.0, seconds - (wire if wire is not None else serial_prior)))
        serial = max(wire if wire is not None else seconds - self.rtt_s, 1e-4)
        sample = min(self.cfg.cap, nbytes * 8 / serial / 1e9) if nbytes else self.gbps
        a = self.cfg.alpha
        self.gbps = 1 / (a / sample + (1 - a) / self.gbps)
        self.transfers += 1
        self.last_transfer_s, self.last_at = seconds, now
        self.consecutive_failures = 0
        if probe:
            self._probe_done()
        if self.open:                       # a probe got through: close the breaker
            self.open = False
            self._backoff = self.cfg.probe_interval_s

    def failure(self, nbytes: int, seconds: float, now: float = 0.0,
                probe: bool = False) -> None:
        """A transfer of ``nbytes`` not acknowledged after ``seconds`` (abandoned)."""
        self.failures += 1
        self.consecutive_failures += 1
        self.last_transfer_s, self.last_at = seconds, now
        if probe:
            self._probe_done()
        if self.open or self.consecutive_failures >= self.cfg.fail_threshold:
            if self.open:                   # a probe failed: wait longer for the next one
                self._backoff = min(self.cfg.probe_interval_max_s, self._backoff * 2)
            self.open = True
            self._next_probe = now + self._backoff

    # -- predictions -------------------------------------------------------------------
    def transfer_s(self, nbytes: int, backlog_bytes: int = 0) -> float:
        """Expected seconds from sending a state of ``nbytes`` (behind ``backlog_bytes``
        already queued on the path) to its acknowledgement."""
        return self.rtt_s + (nbytes + backlog_bytes) * 8 / (self.gbps * 1e9)

    def deadline_s(self, nbytes: int, backlog_bytes: int = 0) -> float:
        """How long a transfer may go unacknowledged before it is abandoned."""
        c = self.cfg
        return min(c.max_deadline_s, max(c.min_deadline_s, c.deadline_factor *
                                         self.transfer_s(nbytes, backlog_bytes)))

    @property
    def state(self) -> str:
        if self.open:
            return DOWN
        if self.slow or self.consecutive_failures:
            return DEGRADED
        return OK

    # -- probes ------------------------------------------------------------------------
    def allow_probe(self, now: float) -> bool:
        """Breaker open: may a probe go now? (one at a time, after the backoff)"""
        return self.probes_in_flight == 0 and now >= self._next_probe

    def share_probe(self, now: float) -> bool:
        """Shipping vetoed as too slow: is this request a probe (one of the
        ``probe_share``, or the first for ``probe_interval_max_s``)?"""
        if self.cfg.probe_share <= 0 or self.probes_in_flight:
            return False
        self._vetoed += 1
        return (self._vetoed % max(1, math.ceil(1 / self.cfg.probe_share)) == 0
                or now - self._last_probe >= self.cfg.probe_interval_max_s)

    def start_probe(self, now: float) -> None:
        self.probes_in_flight += 1
        self.probes += 1
        self._last_probe = now
        if self.open:
            self._next_probe = now + self._backoff

    def _probe_done(self) -> None:
        self.probes_in_flight = max(0, self.probes_in_flight - 1)

    def probe_abandoned(self) -> None:
        """A probe ended without a verdict on the link (e.g. its request was cancelled)."""
        self._probe_done()

    def view(self) -> dict:
        """What ``/cluster`` shows of the path."""
        return {"gbps_estimate": round(self.gbps, 6), "rtt_s": round(self.rtt_s, 6),
                "state": self.state,
                "last_transfer_s": None if self.last_transfer_s is None
                else round(self.last_transfer_s, 4),
                "probes_in_flight": self.probes_in_flight, "transfers": self.transfers,
                "failures": self.failures, "consecutive_failures": self.consecutive_failures,
                "probes": self.probes, "cap_gbps": self.cfg.cap}


class StateSize:
    """Bytes of a shipped state as a function of its tokens, learned from transfers: a
    least-squares line through recent ``(tokens, bytes)`` pairs (a hybrid model's state is
    fixed-size recurrent layers plus attention rows per token).

    Example:
        >>> s = StateSize()
        >>> s.predict(100) is None
        True
        >>> s.observe(100, 6_000 + 100 * 60); s.observe(1000, 6_000 + 1000 * 60)
        >>> s.predict(500)
        36000
    """

    def __init__(self, keep: int = 64):
        self._pts: deque[tuple[int, int]] = deque(maxlen=keep)

    def observe(self, tokens: int, nbytes: int) -> None:
        if tokens > 0 and nbytes > 0:
            self._pts.append((tokens, nbytes))

    def predict(self, tokens: int) -> int | None:
        """Expected bytes for ``tokens``; None before any transfer."""
        if not self._pts:
            return None
        n = len(self._pts)
        mx = sum(t for t, _ in self._pts) / n
        my = sum(b for _, b in self._pts) / n
        var = sum((t - mx) ** 2 for t, _ in self._pts)
        if var == 0:                        # one length seen: scale in proportion
            return round(my * tokens / mx)
        slope = max(0.0, sum((t - mx) * (b - my) for t, b in self._pts) / var)
        return max(1, round(my + slope * (tokens - mx)))
