"""Shipping a SequenceState from a prefill worker to a decode worker over TCP (pyzmq).

One transfer is a series of zmq messages on a PUSH -> PULL pipe, each a multipart message
whose first frame is a JSON header carrying ``rid`` (the request id) and ``type``:

- ``begin``: ``fingerprint`` (of the model: config + weights), ``kinds`` (the layout, one
  kind per layer) and ``num_tokens``;
- ``layer`` (one per layer, sent as soon as prefill has finished that layer, so transfer
  overlaps the remaining layers' compute): ``index``, ``nbytes``, ``crc`` (CRC-32 of the
  second frame), and that frame: the layer as a one-layer flattened
  :class:`~hyla.model.state.SequenceState` (its own header and payload checksum too),
  sent without copying;
- ``end``: ``first_token`` (sampled from the prompt's last logits), its ``logprob``
  (optional) and ``num_layers`` sent;
- ``abort``: ``reason`` (the prefill failed; the receiver gives up at once).

The receiver (:class:`TransferAssembler`, driven by :class:`StateReceiver`'s socket thread)
checks everything: a fingerprint or layout unlike its own model's, a CRC or size mismatch,
a layer that will not unflatten, a missing or duplicated layer, or a transfer that stops
arriving (the waiter's timeout) rejects the transfer with a :class:`TransferError` naming
why; the router then re-runs that prefill locally.

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
import json
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass

import torch

from hyla.model.state import SequenceState

PROTOCOL = 1


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


def layer_buffer(kind: str, tensors: tuple, num_tokens: int) -> torch.Tensor:
    """One layer as a flattened one-layer SequenceState (uint8, on the CPU)."""
    return SequenceState([kind], [tuple(t.cpu() for t in tensors)], num_tokens).flatten()


def _header(**fields) -> bytes:
    return json.dumps({"v": PROTOCOL, **fields}, separators=(",", ":")).encode()


def encode_transfer(rid: str, fingerprint: str, state: SequenceState, first_token: int,
                    logprob: dict | None = None) -> list[list]:
    """A whole state as the list of multipart messages a sender would emit (tests, tools)."""
    msgs = [[_header(type="begin", rid=rid, fingerprint=fingerprint, kinds=state.kinds,
                     num_tokens=state.num_tokens)]]
    for i, (kind, ts) in enumerate(zip(state.kinds, state.tensors, strict=True)):
        buf = layer_buffer(kind, ts, state.num_tokens).numpy()
        msgs.append([_header(type="layer", rid=rid, index=i, nbytes=buf.nbytes,
                             crc=zlib.crc32(buf)), buf])
    msgs.append([_header(type="end", rid=rid, first_token=first_token, logprob=logprob,
                         num_layers=len(state.kinds))])
    return msgs


class _Partial:
    def __init__(self, meta: dict, now: float):
        self.meta, self.t0, self.last = meta, now, now
        self.layers: dict[int, tuple] = {}
        self.nbytes = 0


class TransferAssembler:
    """Reassembles and verifies transfers for one model (no sockets: feed it messages).

    :meth:`feed` takes one multipart message (a list of bytes-like frames) and returns a
    :class:`Transfer` when one completes, a :class:`TransferError` when one is rejected
    (its ``request_id`` attribute names it), or None.
    """

    def __init__(self, fingerprint: str, kinds: list[str], num_layers_max: int = 4096):
        self.fingerprint, self.kinds = fingerprint, list(kinds)
        self.partial: dict[str, _Partial] = {}
        self.rejected: dict[str, str] = {}           # rid -> reason (later messages dropped)

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
            rid, kind = str(meta["rid"]), meta["type"]
        except (ValueError, KeyError, TypeError, IndexError):
            return None                     # not ours: nothing to attribute it to
        if rid in self.rejected:
            return None
        if meta.get("v") != PROTOCOL:
            return self._reject(rid, f"protocol version {meta.get('v')}, expected {PROTOCOL}")
        if kind == "begin":
            if meta.get("fingerprint") != self.fingerprint:
                return self._reject(rid, f"model fingerprint {meta.get('fingerprint')!r} is "
                                         f"not this worker's {self.fingerprint!r}")
            if meta.get("kinds") != self.kinds:
                return self._reject(rid, f"layout {meta.get('kinds')} is not this model's")
            if rid in self.partial:
                return self._reject(rid, "transfer began twice")
            self.partial[rid] = _Partial(meta, now)
            return None
        p = self.partial.get(rid)
        if p is None:
            return self._reject(rid, f"{kind!r} message before 'begin' (partial transfer)")
        p.last = now
        if kind == "abort":
            return self._reject(rid, f"the sender aborted: {meta.get('reason')}")
        if kind == "layer":
            return self._layer(rid, p, meta, frames)
        if kind == "end":
            n = len(self.kinds)
            if meta.get("num_layers") != n or len(p.layers) != n:
                return self._reject(rid, f"partial transfer: {len(p.layers)} of {n} layers "
                                         f"arrived (sender says {meta.get('num_layers')})")
            del self.partial[rid]
            kinds = [p.layers[i][0] for i in range(n)]
            state = SequenceState(kinds, [p.layers[i][1] for i in range(n)],
                                  p.meta["num_tokens"])
            return Transfer(rid, state, int(meta["first_token"]), meta.get("logprob"),
                            p.nbytes, now - p.t0)
        return self._reject(rid, f"unknown message type {kind!r}")

    def _layer(self, rid, p, meta, frames):
        i = meta.get("index")
        if not isinstance(i, int) or not 0 <= i < len(self.kinds):
            return self._reject(rid, f"layer index {i!r} out of range")
        if i in p.layers:
            return self._reject(rid, f"layer {i} arrived twice")
        if len(frames) != 2:
            return self._reject(rid, f"layer {i}: expected 2 frames, got {len(frames)}")
        buf = memoryview(frames[1]).cast("B")
        if buf.nbytes != meta.get("nbytes"):
            return self._reject(rid, f"layer {i}: {buf.nbytes} bytes, header says "
                                     f"{meta.get('nbytes')} (truncated)")
        if zlib.crc32(buf) != meta.get("crc"):
            return self._reject(rid, f"layer {i}: checksum mismatch (corrupt)")
        try:
            one = SequenceState.unflatten(torch.frombuffer(bytearray(buf), dtype=torch.uint8))
        except ValueError as e:
            return self._reject(rid, f"layer {i}: {e}")
        if one.kinds != [self.kinds[i]] or one.num_tokens != p.meta["num_tokens"]:
            return self._reject(rid, f"layer {i}: holds {one.kinds} x {one.num_tokens} "
                                     f"tokens, expected {self.kinds[i]} x "
                                     f"{p.meta['num_tokens']}")
        p.layers[i] = (one.kinds[0], one.tensors[0])
        p.nbytes += buf.nbytes
        return None

    def expire(self, older_than_s: float, now: float | None = None) -> list[TransferError]:
        """Reject transfers that have received nothing for ``older_than_s`` (stalled)."""
        now = time.monotonic() if now is None else now
        stale = [r for r, p in self.partial.items() if now - p.last > older_than_s]
        return [self._reject(r, f"stalled: nothing arrived for {older_than_s:g} s")
                for r in stale]


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
