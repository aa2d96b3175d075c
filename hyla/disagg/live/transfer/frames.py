"""Shipping a SequenceState from a prefill worker to a decode worker over TCP (pyzmq).

A transfer carries one whole :class:`~hyla.model.state.SequenceState`, the state after the
prompt that the prefill worker's engine hands over (:meth:`hyla.serve.engine.Engine.
add_request` with ``prefill_only``). It travels as its :meth:`~hyla.model.state.
SequenceState.flatten` buffer, whose header CRC and payload checksum are the transfer's
one checksum layer, cut into chunks so the link can be paced and a stalled transfer seen.
It is a series of zmq messages on a DEALER -> ROUTER pipe (in order; the receiver
acknowledges each transfer on it), each a multipart message
whose first frame is a JSON header carrying ``v`` (the protocol), ``rid`` (the request id)
and ``type``:

- ``begin``: ``fingerprint`` (of the model: config + weights), ``kinds`` (the layout, one
  kind per layer), ``num_tokens``, ``nbytes`` (of the buffer) and ``chunks``;
- ``chunk`` (``chunks`` of them, ``index`` 0, 1, ...), and a second frame: the next
  ``chunk_bytes`` of the buffer, sent without copying;
- ``end``: ``first_token`` (sampled from the prompt's last logits), its ``logprob``
  (optional) and ``chunks`` sent;
- ``abort``: ``reason`` (the sender failed midway; the receiver gives up at once).

The receiver (:class:`TransferAssembler`, driven by :class:`StateReceiver`'s socket thread)
checks everything and rejects the transfer with a :class:`TransferError` naming why: a
fingerprint or layout unlike its own model's; a chunk out of order (missing or
duplicated); more or fewer bytes than announced (truncated); a buffer that will not
unflatten (corrupt: its header CRC or payload checksum fails); a state of another layout
or length than announced; or a transfer that stops arriving (the waiter's timeout). The
router then re-runs that prefill locally.

A :class:`LinkLimiter` paces the sender to ``link_gbps`` to emulate a cross-cluster link.

Example:
    >>> import torch
    >>> from hyla.model import preset
    >>> from hyla.model.state import SequenceState
    >>> st = SequenceState.empty(preset("debug"))
    >>> msgs = encode_transfer("r1", "fp", st, first_token=7)
    >>> asm = TransferAssembler("fp", st.kinds)
    >>> done = [asm.feed(m) for m in msgs][-1]
    >>> done.first_token, done.state.num_tokens
    (7, 0)
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass

import torch

from hyla.model.state import SequenceState

PROTOCOL = 2
CHUNK_BYTES = 1 << 20       # fine enough to pace a link smoothly and to notice a stall


class TransferError(RuntimeError):
    """A transfer was rejected (corrupt, partial, mismatched) or did not arrive in time."""


@dataclass
class Transfer:
    """A complete, verified transfer."""

    request_id: str
    state: SequenceState
    first_token: int
    logprob: dict | None
    nbytes: int
    seconds: float          # first message to last


def model_fingerprint(model) -> str:
    """sha256 (hex, 16 chars) of a model's config and weights: sender and receiver must match.

    Tensors up to 64 MiB are hashed whole (CRC-32 of their bytes); larger ones by a strided
    sample of about 1M elements, so a multi-GB model is fingerprinted in seconds.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> m = HylaLM(preset("debug"))
        >>> model_fingerprint(m) == model_fingerprint(m)
        True
    """
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.reshape(-1)
        if flat.numel() * flat.element_size() > 64 << 20:
            flat = flat[::max(1, flat.numel() // (1 << 20))]
        raw = flat.contiguous().cpu().view(torch.uint8).numpy()
        h.update(zlib.crc32(raw).to_bytes(4, "little"))
    return h.hexdigest()[:16]


MAC_BYTES = 32              # HMAC-SHA256, the last frame of every message on a keyed channel
MAX_RID_CHARS = 256


def frame_mac(key: bytes, frames: list) -> bytes:
    """HMAC-SHA256 under the cluster secret ``key`` of a message's frames (each prefixed by
    its length, so frames cannot be re-split): the sender appends it as one more frame and
    the receiver drops any message whose last frame is not the MAC of the others.

    Example:
        >>> m = frame_mac(b"k", [b"a", b"bc"])
        >>> len(m), m == frame_mac(b"k", [b"ab", b"c"]), m == frame_mac(b"x", [b"a", b"bc"])
        (32, False, False)
    """
    h = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        view = memoryview(f).cast("B")
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)
    return h.digest()


def check_mac(key: bytes, frames: list) -> list | None:
    """The frames of a message without its MAC frame, or None if the MAC is missing or
    wrong (constant-time comparison)."""
    if len(frames) < 2:
        return None
    body, mac = frames[:-1], bytes(frames[-1])
    return body if hmac.compare_digest(mac, frame_mac(key, body)) else None


def transfer_key(secret: str | bytes | None) -> bytes | None:
    """The transfer channel's HMAC key from a cluster secret (None: unauthenticated).

    Example:
        >>> len(transfer_key("s")), transfer_key(None)
        (32, None)
    """
    if not secret:
        return None
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, b"hyla-transfer-v1", hashlib.sha256).digest()


def _header(**fields) -> bytes:
    return json.dumps({"v": PROTOCOL, **fields}, separators=(",", ":")).encode()


def encode_transfer(rid: str, fingerprint: str, state: SequenceState, first_token: int,
                    logprob: dict | None = None, chunk_bytes: int = CHUNK_BYTES) -> list[list]:
    """The multipart messages that ship ``state``: ``begin``, its flattened buffer in
    ``chunk_bytes`` chunks, ``end``. The sender emits exactly these (tests and tools may
    feed them to a :class:`TransferAssembler` directly)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    buf = state.flatten().cpu().numpy()
    n = -(-buf.nbytes // chunk_bytes)
    msgs = [[_header(type="begin", rid=rid, fingerprint=fingerprint, kinds=list(state.kinds),
                     num_tokens=state.num_tokens, nbytes=buf.nbytes, chunks=n)]]
    for i in range(n):
        msgs.append([_header(type="chunk", rid=rid, index=i),
                     buf[i * chunk_bytes:(i + 1) * chunk_bytes]])
    msgs.append([_header(type="end", rid=rid, first_token=first_token, logprob=logprob,
                         chunks=n)])
    return msgs


class _Partial:
    def __init__(self, meta: dict, now: float):
        self.meta, self.t0, self.last = meta, now, now
        self.parts: list[bytes] = []
        self.nbytes = 0


class TransferAssembler:
    """Reassembles and verifies transfers for one model (no sockets: feed it messages).

    :meth:`feed` takes one multipart message (a list of bytes-like frames) and returns a
    :class:`Transfer` when one completes, a :class:`TransferError` when one is rejected
    (its ``request_id`` attribute names it), or None.
    """

    def __init__(self, fingerprint: str, kinds: list[str], *, vocab_size: int | None = None,
                 max_nbytes: int = 4 << 30, max_partial: int = 64):
        self.fingerprint, self.kinds = fingerprint, list(kinds)
        # Every field of a message is checked before use: token ids against the vocabulary
        # (a bad first token would otherwise reach the batched forward pass), sizes against
        # max_nbytes, and at most max_partial transfers are assembled at once.
        self.vocab_size, self.max_nbytes, self.max_partial = vocab_size, max_nbytes, max_partial
        self.partial: dict[str, _Partial] = {}
        self.rejected: dict[str, str] = {}           # rid -> reason (later messages dropped)
        self.dropped = 0                             # messages with nothing to attribute

    def _reject(self, rid: str, reason: str) -> TransferError:
        self.partial.pop(rid, None)
        self.rejected[rid] = reason
        if len(self.rejected) > 10_000:
            self.rejected.pop(next(iter(self.rejected)))
        err = TransferError(f"transfer of {rid!r} rejected: {reason}")
        err.request_id = rid
        return err

    def feed(self, frames: list, now: float | None = None):
        now = time.monotonic() if now is None else now
        try:
            meta = json.loads(bytes(frames[0]))
            rid, kind = meta["rid"], meta["type"]
            if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS \
                    or not isinstance(kind, str):
                raise TypeError("bad rid or type")
        except (ValueError, KeyError, TypeError, IndexError):
            self.dropped += 1
            return None                     # not ours: nothing to attribute it to
        if rid in self.rejected:
            return None
        if meta.get("v") != PROTOCOL:
            return self._reject(rid, f"protocol version {meta.get('v')}, expected {PROTOCOL}")
        if kind == "begin":
            return self._begin(rid, meta, now)
        p = self.partial.get(rid)
        if p is None:
            return self._reject(rid, f"{kind!r} message before 'begin' (partial transfer)")
        p.last = now
        if kind == "abort":
            return self._reject(rid, f"the sender aborted: {meta.get('reason')}")
        if kind == "chunk":
            return self._chunk(rid, p, meta, frames)
        if kind == "end":
            return self._end(rid, p, meta, now)
        return self._reject(rid, f"unknown message type {kind!r}")

    def _begin(self, rid, meta, now):
        if meta.get("fingerprint") != self.fingerprint:
            return self._reject(rid, f"model fingerprint {meta.get('fingerprint')!r} is "
                                     f"not this worker's {self.fingerprint!r}")
        if meta.get("kinds") != self.kinds:
            return self._reject(rid, f"layout {meta.get('kinds')} is not this model's")
        if rid in self.partial:
            return self._reject(rid, "transfer began twice")
        for key in ("num_tokens", "nbytes", "chunks"):
            if type(meta.get(key)) is not int or meta[key] < 0:
                return self._reject(rid, f"'begin' needs an int {key} >= 0, got "
                                         f"{meta.get(key)!r}")
        if meta["nbytes"] > self.max_nbytes or meta["chunks"] > max(1, meta["nbytes"]):
            return self._reject(rid, f"'begin' announces {meta['nbytes']} bytes in "
                                     f"{meta['chunks']} chunks (limit {self.max_nbytes} bytes)")
        if len(self.partial) >= self.max_partial:
            return self._reject(rid, f"{len(self.partial)} transfers are already in progress "
                                     f"(limit {self.max_partial})")
        self.partial[rid] = _Partial(meta, now)
        return None

    def _chunk(self, rid, p, meta, frames):
        i, want = meta.get("index"), len(p.parts)
        if i != want:
            return self._reject(rid, f"chunk {i!r} arrived, expected chunk {want} (missing or "
                                     f"duplicated chunk)")
        if len(frames) != 2:
            return self._reject(rid, f"chunk {i}: expected 2 frames, got {len(frames)}")
        buf = memoryview(frames[1]).cast("B")
        if p.nbytes + buf.nbytes > p.meta["nbytes"]:
            return self._reject(rid, f"chunk {i}: more bytes than the {p.meta['nbytes']} "
                                     f"announced")
        p.parts.append(bytes(buf))
        p.nbytes += buf.nbytes
        return None

    def _end(self, rid, p, meta, now):
        n, total = p.meta["chunks"], p.meta["nbytes"]
        if meta.get("chunks") != n or len(p.parts) != n:
            return self._reject(rid, f"partial transfer: {len(p.parts)} of {n} chunks "
                                     f"arrived (sender says {meta.get('chunks')})")
        if p.nbytes != total:
            return self._reject(rid, f"{p.nbytes} bytes arrived, {total} announced "
                                     f"(truncated)")
        del self.partial[rid]
        try:
            state = SequenceState.unflatten(torch.frombuffer(bytearray(b"".join(p.parts)),
                                                             dtype=torch.uint8))
        except Exception as e:  # noqa: BLE001 - any failure to unflatten is a corrupt state

            return self._reject(rid, f"state: {e}")
        if state.kinds != self.kinds or state.num_tokens != p.meta["num_tokens"]:
            return self._reject(rid, f"the state holds layers {state.kinds} x "
                                     f"{state.num_tokens} tokens, 'begin' announced "
                                     f"{self.kinds} x {p.meta['num_tokens']}")
        first = meta.get("first_token")
        if type(first) is not int or first < 0 or (self.vocab_size is not None
                                                    and first >= self.vocab_size):
            return self._reject(rid, f"'end' needs an int first_token in [0, "
                                     f"{self.vocab_size}), got {first!r}")
        lp = meta.get("logprob")
        if lp is not None and not _valid_logprob(lp, self.vocab_size):
            return self._reject(rid, f"'end' has a malformed logprob {str(lp)[:100]}")
        return Transfer(rid, state, first, lp, total, now - p.t0)

    def expire(self, older_than_s: float, now: float | None = None) -> list[TransferError]:
        """Reject transfers that have received nothing for ``older_than_s`` (stalled)."""
        now = time.monotonic() if now is None else now
        stale = [r for r, p in self.partial.items() if now - p.last > older_than_s]
        return [self._reject(r, f"stalled: nothing arrived for {older_than_s:g} s")
                for r in stale]


def _valid_logprob(lp, vocab: int | None) -> bool:
    """``{"token": int, "logprob": float, "top": [[int, float], ...]}`` (at most 20)."""
    def tok(t):
        return type(t) is int and t >= 0 and (vocab is None or t < vocab)

    def num(x):
        return type(x) in (int, float)
    try:
        return (isinstance(lp, dict) and tok(lp["token"]) and num(lp["logprob"])
                and isinstance(lp["top"], list) and len(lp["top"]) <= 20
                and all(isinstance(x, list) and len(x) == 2 and tok(x[0]) and num(x[1])
                        for x in lp["top"]))
    except (KeyError, TypeError):
        return False


class LinkLimiter:
    """Paces bytes to ``gbps`` (None: unlimited), like a link of that capacity.

    A virtual clock: each ``acquire(n)`` books the link for ``n * 8 / gbps`` ns after the
    previous booking and sleeps until its bytes would have gone out.

    Example:
        >>> lim = LinkLimiter(gbps=0.008)          # 1 MB/s
        >>> t = time.perf_counter(); lim.acquire(50_000); lim.acquire(50_000)
        >>> round(time.perf_counter() - t, 1)
        0.1
    """

    def __init__(self, gbps: float | None):
        if gbps is not None and not gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (or None: unlimited), got {gbps}")
        self.gbps = gbps
        self._free = 0.0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> None:
        if self.gbps is None:
            return
        with self._lock:
            now = time.perf_counter()
            self._free = max(self._free, now) + nbytes * 8 / (self.gbps * 1e9)
            wait = self._free - now
        if wait > 0:
            time.sleep(wait)


class EgressMeter:
    """Bytes sent, and the rate over a recent window (Gbps)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s, self.total = window_s, 0
        self._events: deque = deque()
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes
            self._events.append((time.monotonic(), nbytes))

    def gbps(self) -> float:
        with self._lock:
            now = time.monotonic()
            while self._events and now - self._events[0][0] > self.window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) * 8 / self.window_s / 1e9
