"""Per-sequence inference state, its size, and a flat byte format for shipping it.

A GLA layer keeps one [H, K, V] float32 matrix whatever the context length; an attention
layer keeps its keys and values [num_tokens, H_kv, D] in the model dtype.

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

from hyla.model.config import LAYER_KINDS, HylaConfig

MAGIC = b"HYLASTAT"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIII")
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class SequenceState:
    """Inference state of one sequence: per layer, a GLA matrix or attention keys/values.

    ``tensors[i]`` is ``(S,)`` with S [H, K, V] float32 for a GLA layer, or ``(keys, values)``,
    each [num_tokens, H_kv, D], for an attention layer. The model updates it in place.

    Example:
        >>> from hyla.model.config import preset
        >>> st = SequenceState.empty(preset("debug"))
        >>> st.num_tokens, st.bytes_by_kind()
        (0, {'gla': 6144, 'attention': 0})
        >>> SequenceState.unflatten(st.flatten()).nbytes == st.nbytes
        True
    """

    def __init__(self, kinds: list[str], tensors: list[tuple[torch.Tensor, ...]],
                 num_tokens: int = 0):
        if len(kinds) != len(tensors):
            raise ValueError(f"tensors must have one entry per layer ({len(kinds)}), "
                             f"got {len(tensors)}")
        for i, (kind, ts) in enumerate(zip(kinds, tensors, strict=True)):
            want = {"gla": 1, "attention": 2}.get(kind)
            if want is None or len(ts) != want:
                raise ValueError(f"layer {i}: kind must be 'gla' (1 tensor) or 'attention' "
                                 f"(keys, values), got {kind!r} with {len(ts)} tensor(s)")
            if kind == "attention" and any(t.shape[0] != num_tokens for t in ts):
                raise ValueError(f"layer {i}: keys/values must have num_tokens={num_tokens} "
                                 f"rows, got {[tuple(t.shape) for t in ts]}")
        self.kinds = list(kinds)
        self.tensors = [tuple(ts) for ts in tensors]
        self.num_tokens = int(num_tokens)

    @classmethod
    def empty(cls, cfg: HylaConfig, device=None, dtype: torch.dtype = torch.float32
              ) -> SequenceState:
        """A state holding no tokens: zero GLA matrices, empty caches of ``dtype``."""
        kinds, tensors = [], []
        for letter in cfg.layers:
            kind = LAYER_KINDS[letter]
            kinds.append(kind)
            if kind == "gla":
                shape = (cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim)
                tensors.append((torch.zeros(shape, device=device, dtype=torch.float32),))
            else:
                shape = (0, cfg.n_kv_heads, cfg.head_dim)
                tensors.append((torch.zeros(shape, device=device, dtype=dtype),
                                torch.zeros(shape, device=device, dtype=dtype)))
        return cls(kinds, tensors, 0)

    @property
    def device(self) -> torch.device:
        return self.tensors[0][0].device

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of all layers (no header, no padding)."""
        return sum(t.numel() * t.element_size() for ts in self.tensors for t in ts)

    def bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes split by layer kind: {"gla": ..., "attention": ...}."""
        out = {"gla": 0, "attention": 0}
        for kind, ts in zip(self.kinds, self.tensors, strict=True):
            out[kind] += sum(t.numel() * t.element_size() for t in ts)
        return out

    def clone(self) -> SequenceState:
        return SequenceState(self.kinds, [tuple(t.clone() for t in ts) for ts in self.tensors],
                             self.num_tokens)

    def to(self, device) -> SequenceState:
        return SequenceState(self.kinds, [tuple(t.to(device) for t in ts) for ts in self.tensors],
                             self.num_tokens)

    def __repr__(self) -> str:
        by = self.bytes_by_kind()
        return (f"SequenceState(layers={''.join(k[0].upper() for k in self.kinds)}, "
                f"num_tokens={self.num_tokens}, gla_bytes={by['gla']}, "
                f"attention_bytes={by['attention']})")

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
        header = json.dumps({"num_tokens": self.num_tokens, "payload_nbytes": offset,
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
            return cls(kinds, tensors, meta["num_tokens"])
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
