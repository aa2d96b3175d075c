"""The files of a DCP checkpoint (``ckpt-<step>/dcp/``): checking them before a resume
trusts them, and reading DCP's pickled ``.metadata`` without running arbitrary code. Kept
apart from :mod:`hyla.train.checkpointing.dcp` so that the checkpoint loader can check a
checkpoint without importing the writer (which imports the loader)."""

from __future__ import annotations

import pathlib
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

DCP = "dcp"
METADATA = ".metadata"


def check_dcp(path: pathlib.Path) -> None:
    """ValueError naming the first file of the DCP checkpoint at ``path`` that is missing or
    shorter than its metadata says (a rank that died mid-save, a copy that lost a file).

    Example:
        >>> import tempfile
        >>> check_dcp(pathlib.Path(tempfile.mkdtemp()) / "dcp")
        Traceback (most recent call last):
        ...
        ValueError: dcp/.metadata is missing
    """
    path = pathlib.Path(path)
    if not (path / METADATA).is_file():
        raise ValueError(f"{path.name}/{METADATA} is missing")
    need: dict[str, int] = {}
    for info in SafeReader(path).read_metadata().storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"shard {path.name}/{name} is missing")
        if file.stat().st_size < size:
            raise ValueError(f"shard {path.name}/{name} is truncated "
                             f"({file.stat().st_size} of {size} bytes)")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; only DCP's own metadata classes and torch's sizes and
    dtypes may be rebuilt from it (loading never runs arbitrary code)."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.memory_format, torch.layout)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


_ALLOWED = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read through an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(pathlib.Path(self.path) / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
