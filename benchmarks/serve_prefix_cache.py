"""Claim: a repeated 4K-token prefix is served from the hybrid prefix cache: the warm
request's time to first token is a small fraction of the cold one's.

Two requests share a 4,096-token prefix and differ in a 32-token suffix. The first (cold)
computes everything; the second (warm) restores the GLA states snapshotted at the
4,096-token boundary and reuses the attention layers' KV blocks, so it computes only its
suffix. Measured for the ``small`` preset's hybrid (GGGA x2) and a GLA-only model of the same
width; TTFT = add_request to the first sampled token, engine steps on this thread.
Medians over repeats, each repeat with a fresh engine and fresh random prompts.

    python benchmarks/serve_prefix_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve_common import hyla_model, random_prompts  # noqa: E402

from hyla.perf import print_table, tune_cpu_allocator, write_results  # noqa: E402
from hyla.serve.engine import Engine, EngineConfig  # noqa: E402
from hyla.serve.sequence import SamplingParams  # noqa: E402


def ttft(eng: Engine, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    seq = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0,
                                                 ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    return time.perf_counter() - t0, seq.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on this 2-vCPU VM a second intra-op thread "
                         "makes the small ops of a decode step 2-5x slower)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    prefix_len = 1024 if args.quick else args.prefix
    repeats = 1 if args.quick else args.repeats
    rows = []
    for name, layers in (("hybrid GGGA x2", None), ("GLA only", "GGGGGGGG")):
        model = hyla_model("small", layers)
        cold, warm, cached = [], [], 0
        for rep in range(repeats):
            prefix, a, b = random_prompts([prefix_len, 32, 32], model.cfg.vocab_size, seed=rep)
            eng = Engine(model, None, EngineConfig(max_num_seqs=4, max_model_len=prefix_len + 64,
                                                   max_num_batched_tokens=8192,
                                                   snapshot_interval=1024))
            c, _ = ttft(eng, prefix + a)
            w, cached = ttft(eng, prefix + b)
            cold.append(c)
            warm.append(w)
        rows.append({"model": name, "prefix": prefix_len,
                     "ttft_cold_ms": 1e3 * statistics.median(cold),
                     "ttft_warm_ms": 1e3 * statistics.median(warm),
                     "speedup": statistics.median(cold) / statistics.median(warm),
                     "cached_tokens": cached})
        print(rows[-1], flush=True)
    print_table(f"TTFT of a repeated {prefix_len}-token prefix (+32-token suffix), cold vs "
                "warm prefix cache", rows)
    path = write_results("serve_prefix_cache_quick" if args.quick else "serve_prefix_cache",
                         rows, repeats=repeats)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
