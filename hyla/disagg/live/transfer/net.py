"""The sockets of a state transfer: :class:`StateSender` (prefill side, a zmq DEALER a
destination; in :mod:`hyla.disagg.live.transfer.sender`) and :class:`StateReceiver`
(decode side, a zmq ROUTER that acknowledges every transfer it completes or rejects). The
wire format and its checks live in :mod:`hyla.disagg.live.transfer`.

Each side owns one background thread that alone touches its zmq sockets (they are not
thread-safe). The sender's thread also flattens, chunks and paces each state, so the
prefill thread that calls :meth:`StateSender.send` goes straight on to the next prompt:
shipping one state overlaps prefilling the next.

Example:
    >>> import asyncio
    >>> from hyla.model import preset
    >>> from hyla.model.state import SequenceState
    >>> st = SequenceState.empty(preset("debug"))
    >>> rx = StateReceiver("fp", st.kinds)
    >>> tx = StateSender("fp")
    >>> tx.send("r1", rx.address, st, first_token=3).wait(10)["chunks"]
    1
    >>> asyncio.run(rx.wait("r1", 10)).first_token
    3
    >>> tx.close(); rx.close()
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict

import zmq

from hyla.disagg.live.transfer.frames import (
    Transfer,
    TransferAssembler,
    TransferError,
    _header,
    check_mac,
    frame_mac,
)
from hyla.disagg.live.transfer.sender import DEFAULT_DEADLINE_S, DEST, Outgoing, StateSender

__all__ = ["DEFAULT_DEADLINE_S", "DEST", "Outgoing", "StateReceiver", "StateSender",
           "fault_injection_enabled"]


class StateReceiver:
    """Binds a zmq ROUTER socket and collects verified transfers for :meth:`wait`; each
    transfer it completes or rejects is acknowledged to its sender on the same connection
    (``{"type": "ack", "rid", "ok", "error", "wire_s", "nbytes"}``, HMAC-signed with
    ``key``), so a sender knows the state arrived whole and loaded.

    ``bind``: a zmq endpoint; port 0 picks a free port (see ``address``). Transfers that
    receive nothing for ``stall_s`` are rejected; finished results are kept ``keep_s``
    seconds for a waiter that has not asked yet. With ``key`` every message must carry a
    valid HMAC frame; a message that fails it, or that cannot be parsed, is dropped and
    counted (``stats``) and the receiver goes on. ``vocab_size`` bounds the shipped first
    token. ``alive`` is False only if its thread died (the worker's health says so).
    """

    def __init__(self, fingerprint: str, kinds: list[str], bind: str = "tcp://127.0.0.1:0",
                 stall_s: float = 30.0, keep_s: float = 120.0, advertise_host: str | None = None,
                 *, key: bytes | None = None, vocab_size: int | None = None):
        self._asm = TransferAssembler(fingerprint, kinds, vocab_size=vocab_size)
        self.key = key
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host, _, port = bind.rpartition(":")
        if port == "0":
            port = str(self._sock.bind_to_random_port(host))
        else:
            self._sock.bind(bind)
        adv = advertise_host or host.removeprefix("tcp://")
        self.address = f"tcp://{adv}:{port}"
        self.stall_s, self.keep_s = stall_s, keep_s
        self._lock = threading.Lock()
        self._done: dict[str, tuple[float, Transfer | TransferError]] = {}
        self._waiters: dict[str, tuple] = {}
        self._peers: OrderedDict[str, bytes] = OrderedDict()   # rid -> its sender's id
        self.stats = {"completed": 0, "rejected": 0, "bytes": 0, "last_error": None,
                      "dropped": 0, "unauthenticated": 0, "acks": 0}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hyla-receiver", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def wait(self, rid: str, timeout: float) -> Transfer:
        """The verified transfer of ``rid``; TransferError if rejected or not complete in
        ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            hit = self._done.pop(rid, None)
            if hit is None:
                self._waiters[rid] = (loop, fut)
        if hit is not None:
            return _result(hit[1])
        try:
            return _result(await asyncio.wait_for(fut, timeout))
        except TimeoutError:
            msg = f"transfer of {rid!r} did not complete within {timeout:g} s (stalled or lost)"
            self._finish(rid, TransferError(msg))
            raise TransferError(msg) from None
        finally:
            with self._lock:
                self._waiters.pop(rid, None)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)

    def _finish(self, rid: str, result) -> None:
        if isinstance(result, TransferError):
            with self._lock:
                self._asm._reject(rid, str(result))
            self.stats["rejected"] += 1
            self.stats["last_error"] = str(result)
        else:
            self.stats["completed"] += 1
            self.stats["bytes"] += result.nbytes
        with self._lock:
            w = self._waiters.pop(rid, None)
            if w is None:
                self._done[rid] = (time.monotonic(), result)
        if w is not None:
            loop, fut = w
            loop.call_soon_threadsafe(_set, fut, result)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_sweep = time.monotonic()
        while not self._stop:
            try:
                if poller.poll(100):
                    self._receive()
                now = time.monotonic()
                if now - last_sweep > 1.0:
                    last_sweep = now
                    self._sweep(now)
            except Exception as e:  # noqa: BLE001 - one bad message never stops the receiver
                self.stats["dropped"] += 1
                self.stats["last_error"] = f"dropped a message: {type(e).__name__}: {e}"[:300]
        self._sock.close(linger=0)

    def _receive(self) -> None:
        raw = self._sock.recv_multipart(copy=False)
        peer, frames = raw[0].bytes, [f.buffer for f in raw[1:]]
        if self.key is not None:
            frames = check_mac(self.key, frames)
            if frames is None:
                self.stats["unauthenticated"] += 1
                self.stats["last_error"] = "dropped a message without a valid HMAC"
                return
        with self._lock:
            before = self._asm.dropped
            r = self._asm.feed(frames)
            self.stats["dropped"] += self._asm.dropped - before
        rid = getattr(r, "request_id", None)
        if rid is None and frames and self._asm.partial:
            try:                    # remember who sends each transfer: the ack goes there
                rid = json.loads(bytes(frames[0]))["rid"]
            except (ValueError, KeyError, TypeError):
                rid = None
            if isinstance(rid, str) and rid in self._asm.partial:
                self._peers[rid] = peer
                self._peers.move_to_end(rid)
                while len(self._peers) > 4096:
                    self._peers.popitem(last=False)
            return
        if r is not None:
            self._peers[rid] = peer
            self._finish(r.request_id, r)
            self._ack(r)

    def _ack(self, r) -> None:
        """Tell the sender of ``r`` (a Transfer or a TransferError) how it ended."""
        rid = r.request_id
        peer = self._peers.pop(rid, None)
        if peer is None:
            return
        ok = isinstance(r, Transfer)
        head = _header(type="ack", rid=rid, ok=ok, error=None if ok else str(r)[:300],
                       wire_s=round(r.seconds, 6) if ok else None,
                       nbytes=r.nbytes if ok else None)
        frames = [head, frame_mac(self.key, [head])] if self.key is not None else [head]
        # counted before sending: the sender may act on the ack before this thread resumes
        self.stats["acks"] += 1
        try:
            self._sock.send_multipart([peer, *frames], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats["acks"] -= 1  # the sender went away: it sees its own deadline

    def _sweep(self, now: float) -> None:
        with self._lock:
            stale = self._asm.expire(self.stall_s, now)
            for rid in [r for r, (t, _) in self._done.items() if now - t > self.keep_s]:
                del self._done[rid]
        for e in stale:
            self._finish(e.request_id, e)
            self._ack(e)


def _set(fut, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _result(r):
    if isinstance(r, TransferError):
        raise r
    return r


def fault_injection_enabled() -> bool:
    """Test-only fault endpoints exist only with ``HYLA_FAULTS=1`` in the environment."""
    return os.environ.get("HYLA_FAULTS") == "1"
