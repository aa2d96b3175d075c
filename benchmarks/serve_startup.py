"""``hyla serve`` start-up: seconds from launching the process to a healthy ``/health``.

The server is ``hyla serve --checkpoint SOURCE --threads 1`` (one thread, as
``benchmarks/vs_llamacpp.py`` runs it), started ``--rounds`` times one after another; each
round records the seconds to the first HTTP answer of ``/health`` (any status: the port is
open, the model may still be warming up, 503 ``{"status": "starting"}``) and to its first
200. It also times ``load_model(SOURCE)`` alone, in a fresh process, the same number of
times. Rows are medians; the machine's load average is written beside them.

``--compare DIR`` runs another revision side by side, in alternating rounds: DIR holds its
``hyla`` package (``git archive REV hyla | tar -x -C DIR``) and goes first on the path.

    python benchmarks/serve_startup.py [--checkpoint smollm2] [--rounds 3] [--quantize int4]
    python benchmarks/serve_startup.py --compare /tmp/hyla-before

Writes benchmarks/results/serve_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx

RESULTS = os.path.join(os.path.dirname(__file__), "results", "serve_startup.json")
LOAD = ("import time, torch; torch.set_num_threads(1); from hyla.model.load import load_model;"
        "t = time.perf_counter(); load_model({source!r}); print(time.perf_counter() - t)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def one_start(source: str, quantize: str, tree: str | None = None) -> dict:
    """Seconds to the first answer of /health and to its first 200, for one launch."""
    port = free_port()
    cmd = [sys.executable, "-m", "hyla", "serve", "--checkpoint", source, "--threads", "1",
           "--port", str(port), "--log-level", "warning"]
    if quantize != "none":
        cmd += ["--quantize", quantize]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(tree), cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    row: dict = {}
    try:
        while time.perf_counter() - began < 300:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None
            if status is not None:
                row.setdefault("first_answer_s", time.perf_counter() - began)
                if status == 200:
                    row["healthy_s"] = time.perf_counter() - began
                    return row
            if proc.poll() is not None:
                raise SystemExit(f"hyla serve exited with {proc.returncode}: {' '.join(cmd)}")
            time.sleep(0.05)
        raise SystemExit("hyla serve was not healthy within 300 s")
    finally:
        proc.terminate()
        proc.wait(30)


def one_load(source: str, tree: str | None = None) -> float:
    out = subprocess.run([sys.executable, "-c", LOAD.format(source=source)], check=True,
                         capture_output=True, text=True, env=_env(tree), cwd=tree)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2",
                        help="any load_model source (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="launches (default: %(default)s)")
    parser.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                        help="hyla serve's --quantize (default: %(default)s)")
    parser.add_argument("--compare", default=None, metavar="DIR",
                        help="a directory holding another revision's hyla package, run side "
                             "by side (default: none)")
    args = parser.parse_args()
    trees = {"this": None} | ({"compare": os.path.abspath(args.compare)} if args.compare
                              else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for kind, tree in trees.items():
            row = one_start(args.checkpoint, args.quantize, tree)
            row["load_model_s"] = one_load(args.checkpoint, tree)
            row["load_average_1m"] = os.getloadavg()[0]
            runs[kind].append(row)
            print(f"round {r + 1} {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                  flush=True)
    med = {kind: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
           for kind, rows in runs.items()}
    print(f"\n{'':18} " + " ".join(f"{k:>8}" for k in med))
    for key in med["this"]:
        print(f"{key:18} " + " ".join(f"{m[key]:8.2f}" for m in med.values()))
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump({"checkpoint": args.checkpoint, "threads": 1, "quantize": args.quantize,
                   "rounds": args.rounds, "machine": f"{platform.machine()} {os.cpu_count()} "
                   f"cores", "nice": os.nice(0), "python": platform.python_version(),
                   "compare": "another revision's hyla package" if args.compare else None,
                   "median": med,
                   "runs": runs}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
