"""The sending side of a state transfer: :class:`StateSender` (a zmq DEALER per decode
worker) and :class:`Outgoing` (one queued transfer). The receiving side and the module
that names both is :mod:`hyla.disagg.live.transfer.net`; the wire format and its checks
live in :mod:`hyla.disagg.live.transfer`.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict

import zmq

from hyla.disagg.live.transfer.frames import (
    CHUNK_BYTES,
    EgressMeter,
    LinkLimiter,
    TransferError,
    _header,
    check_mac,
    encode_transfer,
    frame_mac,
)
from hyla.model.state import SequenceState


class Outgoing:
    """One transfer queued on a :class:`StateSender`; :meth:`wait` for it to be
    acknowledged by the receiver.

    ``stats`` once done: ``bytes``, ``chunks``, ``seconds`` (end to end: the first byte
    handed to the socket to the receiver's acknowledgement that it holds a verified,
    loaded state), ``wire_s`` (the receiver's time from the first message to the last),
    ``queued_s`` (waiting behind earlier transfers on this sender), ``acked`` and ``error``
    (None, or why the transfer failed: rejected, or no acknowledgement by its deadline).
    """

    def __init__(self, rid: str, dest: str, deadline_s: float):
        self.rid, self.dest, self.deadline_s = rid, dest, deadline_s
        self.done = threading.Event()
        self.stats = {"bytes": 0, "chunks": 0, "seconds": 0.0, "wire_s": None,
                      "queued_s": 0.0, "acked": False, "error": None}
        self.t0 = time.perf_counter()
        self.t_send: float | None = None

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the receiver acknowledged the state (or the transfer failed: then
        ``stats["error"]`` says why); the transfer's stats."""
        if not self.done.wait(timeout):
            raise TransferError(f"transfer of {self.rid!r} not sent within {timeout} s")
        return self.stats


DEST = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}$")
#: a transfer without its own deadline must be acknowledged within this
DEFAULT_DEADLINE_S = 30.0


class StateSender:
    """Sends states to decode workers' :class:`StateReceiver` addresses, one at a time, in
    the order :meth:`send` was called, and waits for each receiver's acknowledgement (a
    zmq DEALER per destination; the receiver is a ROUTER that answers on the same
    connection). A transfer counts as sent only once acknowledged.

    ``link_gbps`` paces the bytes (None: unlimited). ``key`` (from
    :func:`~hyla.disagg.live.transfer.transfer_key`) signs every message with an HMAC
    frame (and acknowledgements must carry one too). ``allowed`` (a set of ``tcp://``
    addresses, or None: any) is where it may send: the decode workers registered with the
    router; at most ``max_sockets`` connections are kept (least recently used closed
    first). A transfer not acknowledged within its ``deadline_s`` (:meth:`send`) fails,
    and the connection to its destination is dropped with everything still queued on it,
    so a dead link does not hold later transfers. ``faults`` (a dict, for tests) may hold
    ``corrupt`` (flip the last byte of the next transfer's buffer), ``stall_after_chunks``
    (send that many chunks of the next transfer, then nothing more, not even ``end``: a
    stalled transfer) and ``fingerprint`` (announce this instead: a mismatched model).
    """

    def __init__(self, fingerprint: str, link_gbps: float | None = None,
                 chunk_bytes: int = CHUNK_BYTES, *, key: bytes | None = None,
                 allowed: set[str] | None = None, max_sockets: int = 16):
        self.fingerprint, self.chunk_bytes = fingerprint, chunk_bytes
        self.key, self.allowed, self.max_sockets = key, allowed, max_sockets
        self.limiter = LinkLimiter(link_gbps)
        self.meter = EgressMeter()
        self.faults: dict = {}
        self.stats = {"acked": 0, "failed": 0, "abandoned": 0, "bad_acks": 0}
        self._ctx = zmq.Context.instance()
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._pending: dict[str, Outgoing] = {}       # rid -> sent, awaiting its ack
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://hyla-sender-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="hyla-sender", daemon=True)
        self._thread.start()

    @property
    def num_sockets(self) -> int:
        return len(self._socks)

    def check_dest(self, dest: str) -> None:
        """ValueError unless ``dest`` is a ``tcp://host:port`` this sender may send to."""
        if not isinstance(dest, str) or not DEST.match(dest):
            raise ValueError(f"dest must be a tcp://host:port address, got {str(dest)[:80]!r}")
        if self.allowed is not None and dest not in self.allowed:
            raise ValueError(f"dest {dest!r} is not a decode worker registered with the router")

    def send(self, rid: str, dest: str, state: SequenceState, first_token: int,
             logprob: dict | None = None, deadline_s: float | None = None) -> Outgoing:
        """Queue ``state`` (which must not change afterwards) for ``dest``; returns at once.
        ``deadline_s``: seconds from its first byte to the receiver's acknowledgement
        (default :data:`DEFAULT_DEADLINE_S`). ValueError if ``dest`` is not allowed (see
        :meth:`check_dest`) or the deadline is not > 0."""
        self.check_dest(dest)
        deadline_s = DEFAULT_DEADLINE_S if deadline_s is None else float(deadline_s)
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        out = Outgoing(rid, dest, deadline_s)
        self._q.put((out, (state, int(first_token), logprob)))
        self._wake()
        return out

    def close(self) -> None:
        self._q.put(None)
        self._wake()
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass            # closed or full: the loop polls often enough anyway

    def _sock(self, dest: str) -> zmq.Socket:
        s = self._socks.get(dest)
        if s is None:
            while len(self._socks) >= self.max_sockets:
                old = next(iter(self._socks))
                self._drop(old, "its connection was closed for another destination")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            # A receiver that went away must not block the sender's one thread for good:
            # past this, the transfer fails (and the router re-runs the prompt locally).
            s.setsockopt(zmq.SNDTIMEO, 10_000)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.connect(dest)
            self._socks[dest] = s
        else:
            self._socks.move_to_end(dest)
        return s

    def _drop(self, dest: str, why: str) -> None:
        """Close the connection to ``dest`` (and what zmq still queues on it); its
        transfers awaiting an acknowledgement fail with ``why``."""
        s = self._socks.pop(dest, None)
        if s is not None:
            s.close(linger=0)
        for rid, out in list(self._pending.items()):
            if out.dest == dest:
                del self._pending[rid]
                self._fail(out, why)

    def _fail(self, out: Outgoing, why: str) -> None:
        out.stats["error"] = why
        out.stats["seconds"] = time.perf_counter() - (out.t_send or out.t0)
        self.stats["failed"] += 1
        out.done.set()

    def _frames(self, frames: list) -> list:
        return frames + [frame_mac(self.key, frames)] if self.key is not None else frames

    def _send(self, out: Outgoing, frames: list) -> None:
        n = sum(memoryview(f).nbytes for f in frames)
        self.limiter.acquire(n)
        if out.t_send is None:
            out.t_send = time.perf_counter()
            out.stats["queued_s"] = out.t_send - out.t0
        self._sock(out.dest).send_multipart(self._frames(frames), copy=False)
        self.meter.add(n)
        out.stats["bytes"] += n

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        stop = False
        while not stop:
            while True:                         # every queued job first
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                self._start(*item)
            if stop:
                break
            now = time.perf_counter()
            next_deadline = min((o.t_send + o.deadline_s for o in self._pending.values()),
                                default=now + 0.5)
            socks = [self._socks[d] for d in {o.dest for o in self._pending.values()}
                     if d in self._socks]
            for s in socks:
                poller.register(s, zmq.POLLIN)
            try:
                ready = dict(poller.poll(max(1, min(500, int((next_deadline - now) * 1000)))))
            finally:
                for s in socks:
                    poller.unregister(s)
            if self._wake_rx in ready:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            for s in socks:
                if s in ready:
                    self._acks(s)
            self._expire()
        for out in list(self._pending.values()):
            self._fail(out, "the sender was closed")
        for s in self._socks.values():
            s.close(linger=0)
        self._wake_rx.close(linger=0)

    def _start(self, out: Outgoing, arg: tuple) -> None:
        try:
            self._ship(out, *arg)
        except Exception as e:  # noqa: BLE001 - reported to the waiting prefill job
            if out.stats["bytes"]:          # the receiver began it: tell it to give up
                try:
                    self._sock(out.dest).send_multipart(self._frames(
                        [_header(type="abort", rid=out.rid, reason=repr(e)[:200])]),
                        zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._fail(out, repr(e))
            return
        old = self._pending.pop(out.rid, None)
        if old is not None:             # the same request id again: the old one is moot
            self._fail(old, "superseded by a later transfer of the same request")
        self._pending[out.rid] = out

    def _acks(self, s: zmq.Socket) -> None:
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self.key is not None:
                frames = check_mac(self.key, frames)
            try:
                meta = json.loads(bytes(frames[0])) if frames else {}
                rid = meta["rid"]
                out = self._pending.pop(rid) if meta.get("type") == "ack" else None
            except (ValueError, KeyError, TypeError):
                out = None
            if out is None:
                self.stats["bad_acks"] += 1
                continue
            out.stats["seconds"] = time.perf_counter() - (out.t_send or out.t0)
            wire = meta.get("wire_s")
            out.stats["wire_s"] = float(wire) if isinstance(wire, int | float) else None
            if meta.get("ok") is True:
                out.stats["acked"] = True
                self.stats["acked"] += 1
                out.done.set()
            else:
                self._fail(out, f"the receiver rejected it: {str(meta.get('error'))[:300]}")

    def _expire(self) -> None:
        now = time.perf_counter()
        late = {o.dest: o for o in self._pending.values() if now > o.t_send + o.deadline_s}
        for dest, out in late.items():
            self.stats["abandoned"] += 1
            self._drop(dest, f"no acknowledgement within {out.deadline_s:.2f} s (the link "
                             "is down or slower than estimated): abandoned")

    def _ship(self, out: Outgoing, state: SequenceState, first: int, lp: dict | None) -> None:
        f = self.faults
        fp = f.pop("fingerprint", None) or self.fingerprint
        corrupt = f.pop("corrupt", False)
        stall = f.pop("stall_after_chunks", None)
        msgs = encode_transfer(out.rid, fp, state, first, lp, self.chunk_bytes)
        if corrupt:
            last = msgs[-2]
            last[1] = last[1].copy()
            last[1][-1] ^= 0xFF
        if stall is not None:
            msgs = msgs[:1 + int(stall)]
            msgs = [m for m in msgs if len(m) == 2 or m is msgs[0]]   # never the 'end'
        for m in msgs:
            self._send(out, m)
            out.stats["chunks"] += len(m) == 2
