"""Claim: a small request beside a huge batch request is served within a small multiple of
its own time (issue 32, item 7): the prompts of a batch are scheduled as one request.

One engine (``debug`` preset, eager, CPU), 16 state slots, a 1,024-token step budget. A
batch request of 256 prompts (``--prompt-len`` tokens each, 4 new tokens) starts; once it
holds every slot, a 5-token request asking for 5 tokens arrives. Its latency (arrival to
last token) is compared with its latency alone, for the prompts scheduled as one request
(``group``: what ``/v1/completions`` does with a batch) and as 256 independent requests
(first come, first served over prompts: the scheduling before issue 32).

    python benchmarks/fair_scheduling.py [--prompt-len 300] [--threads 2]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hyla.model import HylaLM, preset  # noqa: E402
from hyla.perf import print_table, write_results  # noqa: E402
from hyla.serve.engine import Engine, EngineConfig  # noqa: E402
from hyla.serve.sequence import SamplingParams  # noqa: E402

SMALL = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def small_latency(eng: Engine) -> float:
    start = time.perf_counter()
    seq = eng.add_request([7] * 5, SMALL, "small")
    while not seq.is_finished:
        eng.step()
    return time.perf_counter() - start


def run(model, n: int, prompt_len: int, grouped: bool | None) -> dict:
    eng = Engine(model, None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                           max_model_len=prompt_len + 16))
    small_latency(eng)                                   # warm up
    if grouped is None:
        return {"batch": "none", "small_s": small_latency(eng)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(n):
        eng.add_request([(i * 7 + j) % 250 + 1 for j in range(prompt_len)], params, f"b-{i}",
                        group="batch" if grouped else None)
    while eng.scheduler.pool.num_free:
        eng.step()
    took = small_latency(eng)
    done = sum(1 for i in range(n) if eng._seqs.get(f"b-{i}") is None)
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return {"batch": "one request" if grouped else f"{n} requests (FCFS)",
            "small_s": took, "batch_prompts_done_before": done,
            "batch_rest_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256, help="batch size (default: 256)")
    ap.add_argument("--prompt-len", type=int, default=300,
                    help="tokens per batch prompt (default: 300)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    alone = run(model, args.prompts, args.prompt_len, None)["small_s"]
    rows = [{"batch": "none", "small_s": round(alone, 4), "x_alone": 1.0}]
    for grouped in (True, False):
        r = run(model, args.prompts, args.prompt_len, grouped)
        rows.append(r | {"small_s": round(r["small_s"], 4),
                         "x_alone": round(r["small_s"] / alone, 1),
                         "batch_rest_s": round(r["batch_rest_s"], 2)})
    print_table(f"a 5-token request beside {args.prompts} prompts of {args.prompt_len} tokens "
                f"(debug preset, 16 slots, 1,024-token steps)", rows)
    write_results("fair_scheduling", rows, prompts=args.prompts, prompt_len=args.prompt_len,
                  threads=args.threads)


if __name__ == "__main__":
    main()
