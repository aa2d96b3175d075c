"""Text sources, streamed one document at a time (a corpus is never loaded whole).

The embedded default corpus is the Python standard library's own source on this machine
(found with ``sysconfig``): always present, no download. Files are split into train and
validation by a hash of their relative path, so the split is the same on every machine that
has the same standard library, and independent of file order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterator

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 5
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def stdlib_files(split: str = "train") -> list[pathlib.Path]:
    """The standard library's ``.py`` files of one split, sorted (site-packages excluded).

    Example:
        >>> files = stdlib_files("validation")
        >>> len(files) > 10 and all(f.suffix == ".py" for f in files)
        True
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return list(_stdlib_files(split))


@functools.lru_cache(maxsize=2)
def _stdlib_files(split: str) -> tuple[pathlib.Path, ...]:
    # Walking and hashing ~1,800 paths takes seconds: once a process is enough.
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chosen = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        bucket = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % 100
        if (bucket < VALIDATION_PERCENT) == (split == "validation"):
            chosen.append(f)
    return tuple(chosen)


def list_documents(path: str | os.PathLike | None, split: str = "train"
                   ) -> list[pathlib.Path] | None:
    """The files of a source whose documents are whole files (the stdlib corpus, a folder),
    for shuffling by file; None for sources read as a stream (.jsonl, .parquet, one file).

    A folder is one split: it is used whole for either.
    """
    if path is None:
        return stdlib_files(split)
    p = pathlib.Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        if not files:
            raise ValueError(f"data folder {str(p)!r} has no {'/'.join(TEXT_SUFFIXES)} files")
        return files
    return None


def iter_documents(path: str | os.PathLike | None = None, split: str = "validation"
                   ) -> Iterator[str]:
    """Yield documents: the stdlib corpus (``path=None``), a folder of text files, a ``.jsonl``
    file with a ``text`` field, a ``.parquet`` file with a ``text`` column (the FineWeb-Edu
    layout; read one record batch at a time), or one text file.

    Example:
        >>> doc = next(iter_documents(None, "validation"))
        >>> isinstance(doc, str)
        True
    """
    files = list_documents(path, split)
    if files is not None:
        for f in files:
            yield f.read_text(encoding="utf-8", errors="replace")
        return
    p = pathlib.Path(path)
    if p.suffix == ".parquet" and p.is_file():
        yield from _parquet_texts(p)
    elif p.suffix == ".jsonl" and p.is_file():
        with p.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{p}:{n}: expected a JSON object with a 'text' string")
                    yield record["text"]
    elif p.is_file():
        yield p.read_text(encoding="utf-8", errors="replace")
    else:
        raise ValueError(f"data {str(p)!r} does not exist: expected a folder of text files, "
                         f"a .jsonl file with a 'text' field, or a text file")


def _parquet_texts(path: pathlib.Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a core dependency
        raise ValueError("reading .parquet needs pyarrow: pip install pyarrow") from e
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise ValueError(f"{path} is not a readable parquet file: {e}") from e
    if "text" not in f.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {f.schema_arrow.names}): "
                         "expected the FineWeb-Edu layout, one document per row in 'text'")
    for batch in f.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text:
                yield text
