"""Claim: a refactor costs no speed. The same serving and model workloads, timed on an
earlier revision of hyla and on the working tree, side by side.

Each repeat runs every workload once per tree, each in a fresh process with that tree first
on ``sys.path`` (the two trees alternate, so machine drift hits both alike); the figure is
the median over repeats of (time on the base) / (time on the working tree): above 1 the
working tree is faster. Only public APIs that both revisions share are used:

- ``engine``: ``Engine.generate`` of the ``small`` preset, 8 prompts of 96 tokens, 24 new
  tokens each, greedy, eager (prefill chunks + batched decode + sampling);
- ``runner decode``: ``Runner.decode`` of 4 sequences at 1,024 tokens of context, per step;
- ``prefill``: ``HylaLM.prefill`` of a 1,024-token prompt;
- ``generate``: ``hyla.model.generate``, 48 tokens after a 32-token prompt (the model's
  own prefill/decode conveniences).

    python benchmarks/compare_revisions.py --base 5d1ab14 [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
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
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
from hyla.model import HylaLM, preset
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams

model = HylaLM(preset("small")).eval()
V = model.cfg.vocab_size
out = {}

def best(fn, n):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

prompts = [torch.randint(0, V, (96,)).tolist() for _ in range(8)]
def engine():
    eng = Engine(model, None, EngineConfig(max_num_seqs=8, max_model_len=256,
                                           max_num_batched_tokens=256))
    eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
out["engine"] = best(engine, 3)

r = Runner(model, max_num_seqs=4, num_kv_blocks=4 * 66, block_size=16)
tables = [list(range(b * 66, b * 66 + 65)) for b in range(4)]
def step():
    r.decode([0, 1, 2, 3], [1, 2, 3, 4], [1024] * 4, tables, 4)
out["runner decode"] = best(step, 30)

ids = torch.randint(0, V, (1024,))
out["prefill"] = best(lambda: model.prefill(ids, model.new_state()), 5)

p = torch.randint(0, V, (32,)).tolist()
out["generate"] = best(lambda: generate(model, p, 48, temperature=0), 3)
print(json.dumps(out))
'''


def run(tree: pathlib.Path) -> dict:
    res = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r})\n"
                          + WORKLOAD], capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="5d1ab14", help="git revision to compare against")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        archive = subprocess.run(["git", "archive", args.base], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(base, filter="data")
        ratios: dict[str, list[float]] = {}
        times: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
        for rep in range(args.repeats):
            old, new = run(base), run(ROOT)
            for k in new:
                ratios.setdefault(k, []).append(old[k] / new[k])
                times["base"].setdefault(k, []).append(old[k])
                times["head"].setdefault(k, []).append(new[k])
            print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
                f"{k} {old[k] * 1e3:.1f}/{new[k] * 1e3:.1f} ms" for k in new), flush=True)
    rows = [{"workload": k, f"{args.base}_ms": statistics.median(times["base"][k]) * 1e3,
             "working_tree_ms": statistics.median(times["head"][k]) * 1e3,
             "speedup": statistics.median(v)} for k, v in ratios.items()]
    print_table(f"working tree vs {args.base} (speedup > 1: faster now; medians of "
                f"{args.repeats})", rows)
    path = write_results("compare_revisions", rows, base=args.base, repeats=args.repeats,
                         ratios=ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
