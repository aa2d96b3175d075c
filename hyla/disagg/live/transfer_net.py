"""The sockets of a state transfer: :class:`StateSender` (prefill side, zmq PUSH) and
:class:`StateReceiver` (decode side, zmq PULL). The wire format and its checks live in
:mod:`hyla.disagg.live.transfer`.

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
import os
import queue
import re
import threading
import time
from collections import OrderedDict

import zmq

from hyla.disagg.live.transfer import (
    CHUNK_BYTES,
    EgressMeter,
    LinkLimiter,
    Transfer,
    TransferAssembler,
    TransferError,
    _header,
    check_mac,
    encode_transfer,
    frame_mac,
)
from hyla.model.state import SequenceState


class Outgoing:
    """One transfer queued on a :class:`StateSender`; :meth:`wait` for it to be sent."""

    def __init__(self, rid: str, dest: str):
        self.rid, self.dest = rid, dest
        self.done = threading.Event()
        self.stats = {"bytes": 0, "chunks": 0, "seconds": 0.0, "error": None}
        self.t0 = time.perf_counter()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until every message was handed to zmq; the transfer's stats."""
        if not self.done.wait(timeout):
            raise TransferError(f"transfer of {self.rid!r} not sent within {timeout} s")
        return self.stats


DEST = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}$")


class StateSender:
    """Sends states to decode workers' :class:`StateReceiver` addresses, one at a time, in
    the order :meth:`send` was called.

    ``link_gbps`` paces the bytes (None: unlimited). ``key`` (from
    :func:`~hyla.disagg.live.transfer.transfer_key`) signs every message with an HMAC
    frame. ``allowed`` (a set of ``tcp://`` addresses, or None: any) is where it may send:
    the decode workers registered with the router; at most ``max_sockets`` connections are
    kept (least recently used closed first). ``faults`` (a dict, for tests) may hold
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
        self._ctx = zmq.Context.instance()
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
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
             logprob: dict | None = None) -> Outgoing:
        """Queue ``state`` (which must not change afterwards) for ``dest``; returns at once.
        ValueError if ``dest`` is not allowed (see :meth:`check_dest`)."""
        self.check_dest(dest)
        out = Outgoing(rid, dest)
        self._q.put((out, (state, int(first_token), logprob)))
        return out

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _sock(self, dest: str) -> zmq.Socket:
        s = self._socks.get(dest)
        if s is None:
            while len(self._socks) >= self.max_sockets:
                _, old = self._socks.popitem(last=False)
                old.close(linger=5000)          # zmq flushes what it holds in the background
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            # A receiver that went away must not block the sender's one thread for good:
            # past this, the transfer fails (and the router re-runs the prompt locally).
            s.setsockopt(zmq.SNDTIMEO, 10_000)
            s.connect(dest)
            self._socks[dest] = s
        else:
            self._socks.move_to_end(dest)
        return s

    def _frames(self, frames: list) -> list:
        return frames + [frame_mac(self.key, frames)] if self.key is not None else frames

    def _send(self, out: Outgoing, frames: list) -> None:
        n = sum(memoryview(f).nbytes for f in frames)
        self.limiter.acquire(n)
        self._sock(out.dest).send_multipart(self._frames(frames), copy=False)
        self.meter.add(n)
        out.stats["bytes"] += n

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                break
            out, arg = item
            try:
                self._ship(out, *arg)
            except Exception as e:  # noqa: BLE001 - reported to the waiting prefill job
                out.stats["error"] = repr(e)
                if out.stats["bytes"]:          # the receiver began it: tell it to give up
                    try:
                        self._sock(out.dest).send_multipart(self._frames(
                            [_header(type="abort", rid=out.rid, reason=repr(e)[:200])]))
                    except zmq.ZMQError:
                        pass
            out.stats["seconds"] = time.perf_counter() - out.t0
            out.done.set()
        for s in self._socks.values():
            s.close(linger=0)

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


class StateReceiver:
    """Binds a zmq PULL socket and collects verified transfers for :meth:`wait`.

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
        self._sock = self._ctx.socket(zmq.PULL)
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
        self.stats = {"completed": 0, "rejected": 0, "bytes": 0, "last_error": None,
                      "dropped": 0, "unauthenticated": 0}
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
        frames = [f.buffer for f in self._sock.recv_multipart(copy=False)]
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
        if r is not None:
            self._finish(r.request_id, r)

    def _sweep(self, now: float) -> None:
        with self._lock:
            stale = self._asm.expire(self.stall_s, now)
            for rid in [r for r, (t, _) in self._done.items() if now - t > self.keep_s]:
                del self._done[rid]
        for e in stale:
            self._finish(e.request_id, e)


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
