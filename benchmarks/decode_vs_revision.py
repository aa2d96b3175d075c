"""Claim: single-request decode of a real model is faster on the working tree than on an
earlier revision, for each ``--quantize`` scheme, through the engine (``hyla serve``) and
through ``hyla generate``'s loop.

Each repeat runs the same workload once per tree, each in a fresh process with that tree
first on ``sys.path``, the trees alternating (machine drift hits both alike). Workload, one
torch thread, SmolLM2-135M-Instruct Q4_1 by default, per scheme and prompt length:

- ``engine``: one greedy request through ``Engine`` (default config, one slot): decode
  tok/s after the first token;
- ``generate``: ``hyla.cli.common.generate_text`` (what ``hyla generate`` runs): the CPU
  time of a ``--max-tokens N`` call minus that of a ``--max-tokens 1`` call, per token.

Rates are by this thread's CPU time (steady under load from other processes) and, for the
engine, by wall time too; medians over repeats.

    python benchmarks/decode_vs_revision.py --base HEAD [--repeats 2]

Writes ``benchmarks/results/decode_vs_revision.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyla.perf import print_table, write_results  # noqa: E402

WORKLOAD = r'''
import argparse, copy, json, statistics, sys, time
import torch
torch.set_num_threads(1)
from hyla.cli.common import generate_text
from hyla.model.load import load_model
from hyla.model.quantize import quantize_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

source, schemes, prompts, tokens = sys.argv[1], sys.argv[2].split(","), \
    [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
base, tok = load_model(source)
out = {}

def engine_rate(eng, prompt):
    eng.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    first = cpu = None
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.token_ids)
            if first is None and o.token_ids:
                first, cpu, n = time.perf_counter(), time.thread_time(), 0
    return n / (time.perf_counter() - first), n / (time.thread_time() - cpu)

def gen_cpu(model, text, n):
    args = argparse.Namespace(max_tokens=n, temperature=0.0, top_k=None, top_p=1.0, seed=0)
    c = time.thread_time()
    generate_text(model, tok, text, args)
    return time.thread_time() - c

for scheme in schemes:
    model = copy.deepcopy(base)
    quantize_model(model, scheme)
    for n in prompts:
        ids = [(17 + 31 * i) % model.cfg.vocab_size for i in range(n)]
        eng = Engine(model, None, EngineConfig(max_num_seqs=1, max_model_len=n + tokens + 16))
        engine_rate(eng, ids)                       # warm-up; the prompt is cached after
        rates = [engine_rate(eng, ids) for _ in range(2)]
        text = tok.decode(ids)
        gen_cpu(model, text, 2)                     # warm-up
        one = gen_cpu(model, text, 1)
        full = gen_cpu(model, text, tokens)
        out[f"{scheme}/{n}"] = {
            "engine_wall": statistics.median(r[0] for r in rates),
            "engine_cpu": statistics.median(r[1] for r in rates),
            "generate_cpu": (tokens - 1) / max(full - one, 1e-9)}
        del eng
print("RESULT " + json.dumps(out))
'''


def run_tree(tree: pathlib.Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", WORKLOAD, args.checkpoint, args.schemes,
                           args.prompts, str(args.tokens)], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"workload failed on {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against "
                   "(default: %(default)s)")
    p.add_argument("--checkpoint", default="smollm2", help="default: %(default)s")
    p.add_argument("--schemes", default="none,int8,int4", help="default: %(default)s")
    p.add_argument("--prompts", default="128,1024", help="default: %(default)s")
    p.add_argument("--tokens", type=int, default=16, help="default: %(default)s")
    p.add_argument("--repeats", type=int, default=2, help="default: %(default)s")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.base, "hyla"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as t:
            t.extractall(base, filter="data")
        trees = {"base": base, "tree": ROOT}
        got: dict = {k: [] for k in trees}
        for r in range(args.repeats):
            for name, tree in trees.items():
                got[name].append(run_tree(tree, args))
                print(f"repeat {r} {name}: {got[name][-1]}", flush=True)
    rows = []
    for key in got["base"][0]:
        row = {"scheme/prompt": key}
        for metric in ("engine_cpu", "engine_wall", "generate_cpu"):
            b = statistics.median(x[key][metric] for x in got["base"])
            t = statistics.median(x[key][metric] for x in got["tree"])
            row[f"{metric}_before"], row[f"{metric}_after"] = round(b, 2), round(t, 2)
            row[f"{metric}_x"] = round(t / b, 3)
        rows.append(row)
    print_table(f"single-request decode tok/s, {args.base} (before) vs working tree (after), "
                f"1 thread, load {os.getloadavg()[0]:.1f}", rows)
    path = write_results("decode_vs_revision", rows,
                         params={"base": args.base, "checkpoint": args.checkpoint,
                                 "tokens": args.tokens, "repeats": args.repeats,
                                 "load_avg": os.getloadavg()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
