"""Measurement helpers shared by the benchmarks: machine description, timing, results files.

Every benchmark prints a table (:func:`print_table`) and writes JSON with the machine and
versions (:func:`write_results`), so a figure in the README can be traced to a run.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
REPO_ROOT = RESULTS_DIR.parent.parent
# where machine-specific paths start (URL paths such as /v1/completions do not)
_MACHINE_ROOTS = ("/tmp/", "/home/", "/root/", "/work/", "/Users/", "/var/", "/mnt/",
                  "/private/", "/scratch/", "/data/")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Describe this machine and the software versions, for a results file.

    Example:
        >>> info = machine_info()
        >>> {"cpu", "cores", "cuda_device", "torch"} <= set(info)
        True
    """
    import numpy

    cuda = torch.cuda.is_available()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_allocator": "glibc, tuned (hyla.perf.tune_cpu_allocator)" if _ALLOCATOR["tuned"]
        else "default",
    }


_ALLOCATOR = {"tuned": False}


def release_freed_memory() -> bool:
    """Hand memory the process has freed back to the OS (glibc's ``malloc_trim``): after a
    large one-off release, such as the float weights that quantisation replaced (about
    420 MB for SmolLM2-135M), which glibc would otherwise keep. Returns True if it ran.

    Example:
        >>> release_freed_memory() in (True, False)
        True
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def tune_cpu_allocator() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS at once.

    PyTorch's CPU allocator is plain malloc: every large temporary is a fresh mmap, and on
    virtual machines the page faults of touching it again cost more than the arithmetic
    (measured here: chunk_gla at T = 4096 ran in 224 ms with the default, 96 ms tuned). The
    usual fixes are jemalloc/tcmalloc via LD_PRELOAD; this does the same job in-process with
    two mallopt calls (no mmap for big blocks, no trimming), at the price of the process
    holding on to its peak memory. Returns True if it applied (Linux with glibc).

    Example:
        >>> tune_cpu_allocator() in (True, False)
        True
    """
    if _ALLOCATOR["tuned"]:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
        ok = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False
    _ALLOCATOR["tuned"] = ok
    return ok


def _sync(device: str | torch.device | None = None) -> None:
    # CUDA launches are asynchronous: without a sync we would time the launch, not the work.
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs.

    Synchronises CUDA around each run when CUDA is available.

    Example:
        >>> t = time_fn(lambda: sum(range(1000)), repeats=3)
        >>> t > 0
        True
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5,
                      device: str | torch.device = "cpu") -> float:
    """Measured dense ``size x size`` matmul throughput in FLOP/s (median of ``repeats``).

    Example:
        >>> matmul_peak_flops(size=64, repeats=2) > 0
        True
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = time_fn(lambda: torch.mm(a, b), repeats=repeats, warmup=1)
    return 2.0 * size**3 / seconds


def write_results(name: str, rows: list[dict], *, results_dir: str | os.PathLike | None = None,
                  **extra: Any) -> pathlib.Path:
    """Write ``benchmarks/results/<name>.json`` = {"machine", "rows", **extra}; return its path.

    Example:
        >>> import tempfile
        >>> p = write_results("demo", [{"n": 1}], results_dir=tempfile.mkdtemp(), note="x")
        >>> p.name
        'demo.json'
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a plain file stem, got {name!r}")
    out_dir = pathlib.Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = without_machine_paths({"machine": machine_info(),
                                     "date": datetime.now(UTC).isoformat(timespec="seconds"),
                                     "rows": rows, **extra})
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def without_machine_paths(value: Any) -> Any:
    """``value`` with every absolute path of this machine made relative: to the repository
    when inside it, else to its last part (results are published; home folders, temporary
    folders and user names are not theirs to carry).

    Example:
        >>> without_machine_paths({"work": "/tmp/run1", "n": [1, "/home/u/x/trace.csv"]})
        {'work': 'run1', 'n': [1, 'trace.csv']}
    """
    if isinstance(value, dict):
        return {k: without_machine_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_machine_paths(v) for v in value]
    if isinstance(value, pathlib.PurePath):
        value = str(value)
    if isinstance(value, str) and value.startswith(_MACHINE_ROOTS + (str(REPO_ROOT),)) \
            and "\n" not in value and len(value) < 4096:
        path = pathlib.Path(value)
        try:
            return str(path.relative_to(REPO_ROOT))
        except ValueError:
            return path.name
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e9 or abs(value) < 1e-3):
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, rows: Sequence[dict], *, console: Any = None) -> None:
    """Print ``rows`` (dicts sharing keys) as a rich table; columns in first-seen key order.

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> out = Console(file=io.StringIO(), width=40)
        >>> print_table("demo", [{"n": 1, "seconds": 0.5}], console=out)
        >>> "seconds" in out.file.getvalue()
        True
    """
    from rich.console import Console
    from rich.table import Table

    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(col, "")) for col in columns))
    if console is None:
        console = Console()
        # Piped output defaults to 80 columns, which truncates wide benchmark tables.
        if not console.is_terminal:
            console = Console(width=200)
    console.print(table)
