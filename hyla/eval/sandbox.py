"""Run model-written Python against its tests in a child process with limits.

The child is a fresh ``python -I`` (no user site, no environment variables read, no current
directory on its path) in an empty temporary directory, with CPU seconds, address space,
file size, open files and processes bounded by ``resource`` limits set before it starts, a
wall-clock timeout, and its output read to a cap. It is not a security boundary against a
determined attacker (the code runs as this user, with network access if the machine has
it; and for root the process count is not limited, since Linux does not enforce
``RLIMIT_NPROC`` for root); it keeps a wrong or runaway completion from hanging or
exhausting the evaluation.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile

OUTPUT_CAP = 4096        # bytes of the child's output kept for the report


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use: wall seconds, CPU seconds, address space (MB), file size
    (MB), open files, processes."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 1
    open_files: int = 64
    processes: int = 0        # 0: no new processes beyond what the user already runs


def _limit(limits: Limits):
    def apply() -> None:
        import resource

        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        if limits.processes == 0 and os.getuid() != 0:     # root ignores RLIMIT_NPROC
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        os.setsid()              # its own process group: a timeout kills all of it
    return apply


def run_python(program: str, limits: Limits | None = None) -> tuple[bool, str]:
    """(whether ``program`` exited 0 within the limits, what it printed or why it failed).

    Example:
        >>> run_python("assert 1 + 1 == 2")
        (True, '')
        >>> run_python("while True: pass", Limits(wall_s=2, cpu_s=1))[0]
        False
    """
    limits = limits or Limits()
    with tempfile.TemporaryDirectory(prefix="hyla-sandbox-") as tmp:
        path, log = os.path.join(tmp, "program.py"), os.path.join(tmp, "output")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        # output to a file, which the file-size limit caps (a pipe would buffer whatever a
        # printing loop writes until the CPU limit)
        with open(log, "wb") as sink:
            try:
                proc = subprocess.Popen(   # by its relative name: no machine path in notes
                    [sys.executable, "-I", "-S", "program.py"], cwd=tmp,
                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                    env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                    preexec_fn=_limit(limits))
            except OSError as e:
                return False, f"could not start: {e}"
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return False, f"timed out after {limits.wall_s:g} s"
        with open(log, "rb") as f:          # its start and its end (where the error is)
            data = f.read()
        if len(data) > OUTPUT_CAP:
            data = data[:OUTPUT_CAP // 2] + b"\n...\n" + data[-OUTPUT_CAP // 2:]
        text = data.decode("utf-8", "replace")
        if len(data) < os.path.getsize(log) and os.path.getsize(log) >= limits.file_mb << 20:
            text += f"\n(its output reached the {limits.file_mb} MB limit)"
        if proc.returncode < 0:
            text += f"\n(killed by signal {-proc.returncode}: a limit reached)"
        return proc.returncode == 0, text.strip()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
