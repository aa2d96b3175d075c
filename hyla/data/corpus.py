"""Text sources, streamed one document at a time (a corpus is never loaded whole).

The embedded default corpus is the Python standard library's own source on this machine
(found with ``sysconfig``): always present, no download. Files are split into train and
validation by a hash of their relative path, so the split is the same on every machine that
has the same standard library, and independent of file order.
"""

from __future__ import annotations

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
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chosen = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        bucket = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % 100
        if (bucket < VALIDATION_PERCENT) == (split == "validation"):
            chosen.append(f)
    return chosen


def iter_documents(path: str | os.PathLike | None = None, split: str = "validation"
                   ) -> Iterator[str]:
    """Yield documents: the stdlib corpus (``path=None``), a folder of text files, a ``.jsonl``
    file with a ``text`` field, or one text file.

    Example:
        >>> doc = next(iter_documents(None, "validation"))
        >>> isinstance(doc, str)
        True
    """
    if path is None:
        for f in stdlib_files(split):
            yield f.read_text(encoding="utf-8", errors="replace")
        return
    p = pathlib.Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        if not files:
            raise ValueError(f"data folder {str(p)!r} has no {'/'.join(TEXT_SUFFIXES)} files")
        for f in files:
            yield f.read_text(encoding="utf-8", errors="replace")
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
