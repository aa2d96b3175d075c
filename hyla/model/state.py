"""Per-sequence inference state, its size, and a flat byte format for shipping it.

Each layer keeps what its mixer's :class:`~hyla.model.mixers.StateSpec` declares: fixed-size
tensors (a GLA layer's [H, K, V] float32 matrix) and tensors that grow a row a token (an
attention layer's keys and values [num_tokens, H_kv, D] in the model dtype).

Flat format (all integers little-endian)::

    b"HYLASTAT" | u32 version | u32 header length | u32 crc32(header) | u32 0
    | header (UTF-8 JSON) | zero padding to a multiple of 64 | payload

The JSON holds ``num_tokens``, ``payload_nbytes``, the payload's CRC-32 and, per layer, its
kind and its tensors' shapes and dtypes. Each tensor's bytes start at a multiple of 64 in
the payload, so a receiver can view them in place.
"""

from __future__ import annotations

import json
import math
import struct
import zlib

import torch

from hyla.model.mixers import MIXERS, StateSpec, layer_specs

MAGIC = b"HYLASTAT"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIII")
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class SequenceState:
    """Inference state of one sequence: per layer, the tensors its mixer's StateSpec names.

    ``kinds[i]`` is layer i's mixer kind and ``tensors[i]`` its tensors in spec order (fixed
    entries, then growing ones): ``(S,)`` with S [H, K, V] float32 for a GLA layer,
    ``(keys, values)``, each [num_tokens, H_kv, D], for an attention layer. The model updates
    it in place.

    ``start`` > 0: the growing entries hold only the rows from token ``start`` on
    (``[num_tokens - start, ...]``), for a receiver that holds the first ``start`` tokens'
    rows already (a cached prefix: :meth:`suffix`); the fixed entries are whole. Such a state
    is shipped and loaded, not run.

    Example:
        >>> from hyla.model.config import preset
        >>> st = SequenceState.empty(preset("debug"))
        >>> st.num_tokens, st.bytes_by_kind()["gla"], st.bytes_by_kind()["attention"]
        (0, 6144, 0)
        >>> SequenceState.unflatten(st.flatten()).nbytes == st.nbytes
        True
    """

    def __init__(self, kinds: list[str], tensors: list[tuple[torch.Tensor, ...]],
                 num_tokens: int = 0, start: int = 0):
        if len(kinds) != len(tensors):
            raise ValueError(f"tensors must have one entry per layer ({len(kinds)}), "
                             f"got {len(tensors)}")
        for i, (kind, ts) in enumerate(zip(kinds, tensors, strict=True)):
            if not isinstance(kind, str) or not all(isinstance(t, torch.Tensor) for t in ts):
                raise ValueError(f"layer {i}: expected a kind name and a tuple of tensors, "
                                 f"got {kind!r} with {[type(t).__name__ for t in ts]}")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if not isinstance(start, int) or not 0 <= start <= num_tokens:
            raise ValueError(f"start must be an int in [0, num_tokens={num_tokens}], got "
                             f"{start!r}")
        self.kinds = list(kinds)
        self.tensors = [tuple(ts) for ts in tensors]
        self.num_tokens = int(num_tokens)
        self.start = int(start)

    @classmethod
    def empty(cls, cfg, device=None, dtype: torch.dtype = torch.float32) -> SequenceState:
        """A state holding no tokens: zero fixed tensors, empty growing ones; ``dtype`` is
        the model's (entries whose spec names no dtype take it)."""
        specs = layer_specs(cfg)
        tensors = [tuple(torch.zeros(e.shape, device=device, dtype=e.resolve(dtype))
                         for e in spec.fixed)
                   + tuple(torch.zeros((0, *e.shape), device=device, dtype=e.resolve(dtype))
                           for e in spec.per_token)
                   for spec in specs]
        return cls([s.kind for s in specs], tensors, 0)

    def mismatch(self, specs: list[StateSpec]) -> str:
        """What keeps this state from fitting layers with ``specs`` ('' when it fits)."""
        if self.kinds != [s.kind for s in specs]:
            return f"got layer kinds {self.kinds}"
        for i, (spec, ts) in enumerate(zip(specs, self.tensors, strict=True)):
            if len(ts) != len(spec.entries):
                return f"layer {i} has {len(ts)} tensors, its spec {list(spec.names)}"
            want = [e.shape for e in spec.fixed] + [(self.num_tokens - self.start, *e.shape)
                                                    for e in spec.per_token]
            for e, t, shape in zip(spec.entries, ts, want, strict=True):
                if tuple(t.shape) != shape or (e.dtype is not None and t.dtype != e.dtype):
                    return (f"layer {i} {e.name!r} is {t.dtype} {tuple(t.shape)}, expected "
                            f"{e.dtype or 'model dtype'} {shape}")
        return ""

    @staticmethod
    def as_buffers(states: list[SequenceState], specs: list[StateSpec], *, extra_rows: int,
                   block_rows: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The states as a batch's buffers (for a :class:`~hyla.model.context.Context`):
        fixed entries ``[B, *shape]`` (a view of the state's own tensor when B == 1, so it
        is updated in place), growing entries one block a sequence ``[B, rows, *shape]``
        with room for ``extra_rows`` more rows. Read them back with :meth:`take_buffers`."""
        if any(s.start for s in states):
            raise ValueError("a state without its first rows (start > 0) cannot run: load it "
                             "where its prefix is cached")
        rows = block_rows or max(s.num_tokens for s in states) + extra_rows
        out = []
        for i, spec in enumerate(specs):
            layer = {}
            nf = len(spec.fixed)
            for k, e in enumerate(spec.fixed):
                ts = [s.tensors[i][k] for s in states]
                layer[e.name] = ts[0][None] if len(ts) == 1 else torch.stack(ts)
            for k, e in enumerate(spec.per_token):
                first = states[0].tensors[i][nf + k]
                buf = first.new_zeros((len(states), rows, *e.shape))
                for b, s in enumerate(states):
                    buf[b, :s.num_tokens] = s.tensors[i][nf + k]
                layer[e.name] = buf
            out.append(layer)
        return out

    @staticmethod
    def take_buffers(states: list[SequenceState], buffers: list[dict[str, torch.Tensor]],
                     specs: list[StateSpec], num_tokens: list[int]) -> None:
        """Write :meth:`as_buffers`' buffers, after a forward, back into the states."""
        for b, s in enumerate(states):
            tensors = []
            for spec, layer, old in zip(specs, buffers, s.tensors, strict=True):
                ts = []
                for e, t in zip(spec.fixed, old, strict=False):
                    new = layer[e.name][b]
                    if new.data_ptr() != t.data_ptr():
                        t.copy_(new)
                    ts.append(t)
                for e in spec.per_token:
                    rows = layer[e.name][b, :num_tokens[b]]
                    ts.append(rows if len(states) == 1 else rows.clone())
                tensors.append(tuple(ts))
            s.tensors = tensors
            s.num_tokens = num_tokens[b]

    @property
    def device(self) -> torch.device:
        return self.tensors[0][0].device

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of all layers (no header, no padding)."""
        return sum(t.numel() * t.element_size() for ts in self.tensors for t in ts)

    def bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes split by layer kind: {"gla": ..., "attention": ...}, one key per
        registered mixer kind (0 where the model has none)."""
        out = dict.fromkeys(self.kinds + [m.kind for m in MIXERS.values()], 0)
        for kind, ts in zip(self.kinds, self.tensors, strict=True):
            out[kind] += sum(t.numel() * t.element_size() for t in ts)
        return out

    def clone(self) -> SequenceState:
        return SequenceState(self.kinds, [tuple(t.clone() for t in ts) for ts in self.tensors],
                             self.num_tokens, self.start)

    def to(self, device) -> SequenceState:
        return SequenceState(self.kinds, [tuple(t.to(device) for t in ts) for ts in self.tensors],
                             self.num_tokens, self.start)

    def suffix(self, start: int, specs: list[StateSpec]) -> SequenceState:
        """This state without the growing entries' rows before token ``start`` (views): what
        a receiver holding those tokens' rows in a cached prefix needs. ``specs``: the
        model's (which entries grow).

        Example:
            >>> from hyla.model.config import preset
            >>> from hyla.model.state import layer_specs
            >>> cfg = preset("debug"); specs = layer_specs(cfg)
            >>> st = SequenceState.empty(cfg)
            >>> st = SequenceState(st.kinds, [ts[:len(s.fixed)] + tuple(
            ...     t.new_zeros((10, *t.shape[1:])) for t in ts[len(s.fixed):])
            ...     for s, ts in zip(specs, st.tensors)], 10)
            >>> part = st.suffix(8, specs)
            >>> part.start, part.nbytes < st.nbytes, part.mismatch(specs)
            (8, True, '')
        """
        if not 0 <= start <= self.num_tokens or start < self.start:
            raise ValueError(f"start must be in [{self.start}, {self.num_tokens}], got {start}")
        cut = start - self.start
        # fixed entries first, then the growing ones (spec order)
        tensors = [ts[:len(spec.fixed)] + tuple(t[cut:] for t in ts[len(spec.fixed):])
                   for spec, ts in zip(specs, self.tensors, strict=True)]
        return SequenceState(self.kinds, tensors, self.num_tokens, start)

    def __repr__(self) -> str:
        start = f", start={self.start}" if self.start else ""
        return (f"SequenceState(num_tokens={self.num_tokens}{start}, "
                f"bytes_by_kind={self.bytes_by_kind()})")

    def flatten(self) -> torch.Tensor:
        """One contiguous uint8 buffer (header + payload) on the state's device.

        Example:
            >>> from hyla.model.config import preset
            >>> buf = SequenceState.empty(preset("debug")).flatten()
            >>> buf.dtype, bytes(buf[:8].tolist())
            (torch.uint8, b'HYLASTAT')
        """
        layout, offset = [], 0
        for kind, ts in zip(self.kinds, self.tensors, strict=True):
            entries = []
            for t in ts:
                entries.append({"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                                "offset": offset})
                offset = _align(offset + t.numel() * t.element_size())
            layout.append({"kind": kind, "tensors": entries})
        payload = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        for ts, entry in zip(self.tensors, layout, strict=True):
            for t, e in zip(ts, entry["tensors"], strict=True):
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                payload[e["offset"]:e["offset"] + raw.numel()] = raw
        header = json.dumps({"num_tokens": self.num_tokens, "start": self.start,
                             "payload_nbytes": offset,
                             "checksum": _checksum(payload), "layers": layout},
                            separators=(",", ":")).encode()
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(header), 0)
        head = prefix + header
        head += bytes(_align(len(head)) - len(head))
        head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.device)
        return torch.cat([head_t, payload])

    @classmethod
    def unflatten(cls, buffer: torch.Tensor, device=None) -> SequenceState:
        """Rebuild a state from :meth:`flatten`'s buffer; ValueError if corrupt or truncated.

        The state owns fresh tensors (on ``device``, default the buffer's device), so the
        buffer can be reused afterwards.
        """
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 \
                or buffer.dim() != 1:
            got = (f"{buffer.dtype} {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor)
                   else type(buffer).__name__)
            raise ValueError(f"buffer must be a 1-D uint8 tensor, got {got}")
        device = buffer.device if device is None else torch.device(device)
        n = buffer.numel()
        if n < _PREFIX.size:
            raise ValueError(f"buffer is truncated: {n} bytes, shorter than the "
                             f"{_PREFIX.size}-byte prefix")
        magic, version, hlen, hcrc, _ = _PREFIX.unpack(bytes(buffer[:_PREFIX.size].tolist()))
        if magic != MAGIC:
            raise ValueError(f"buffer must start with magic {MAGIC!r}, got {magic!r}")
        if version != VERSION:
            raise ValueError(f"buffer has version {version}, expected {VERSION}")
        start = _align(_PREFIX.size + hlen)
        if n < start:
            raise ValueError(f"buffer is truncated: {n} bytes, header needs {start}")
        header = bytes(buffer[_PREFIX.size:_PREFIX.size + hlen].tolist())
        if zlib.crc32(header) != hcrc:
            raise ValueError("buffer header is corrupt (crc32 mismatch)")
        try:
            meta = json.loads(header)
            if not isinstance(meta, dict):
                raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
            size = int(meta["payload_nbytes"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"buffer header is not a valid layout: {err}") from err
        if n != start + size:
            raise ValueError(f"buffer must be {start + size} bytes (header {start} + payload "
                             f"{size}), got {n}: truncated or padded")
        payload = buffer[start:]
        if _checksum(payload) != meta.get("checksum"):
            raise ValueError("buffer payload is corrupt (checksum mismatch)")
        try:
            kinds, tensors = [], []
            for layer in meta["layers"]:
                ts = []
                for e in layer["tensors"]:
                    dtype = _DTYPES[e["dtype"]]
                    count = math.prod(e["shape"]) * dtype.itemsize
                    if not 0 <= e["offset"] <= e["offset"] + count <= size:
                        raise ValueError(f"tensor bytes {e['offset']}+{count} outside payload")
                    raw = payload[e["offset"]:e["offset"] + count].clone()
                    ts.append(raw.view(dtype).reshape(e["shape"]).to(device))
                kinds.append(layer["kind"])
                tensors.append(tuple(ts))
            return cls(kinds, tensors, meta["num_tokens"], meta.get("start", 0))
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"buffer header has an invalid layout: {err}") from err


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"state tensors must have dtype in {sorted(_DTYPES)}, got {dtype}")
    return name


def _checksum(payload: torch.Tensor) -> int:
    """CRC-32 of the payload bytes (on the host: a GPU payload is copied once)."""
    return zlib.crc32(payload.cpu().numpy())
