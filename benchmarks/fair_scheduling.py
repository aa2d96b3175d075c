"""A small request beside a huge batch request is served within a small multiple of its time.

Engine (``debug`` preset, eager, 2 threads), 16 slots, 1,024-token steps: a 5-token request
for 5 tokens alone, and once a batch of 256 prompts of 300 tokens (4 new each) holds every
slot, the batch as one request (issue 32) or as 256 (first come, first served).
``--quick``: 32 prompts of 100 tokens.
"""

import time

import torch

from benchmarks.serve_common import engine, greedy
from hyla.model import HylaLM, preset


def small_latency(eng) -> float:
    start, seq = time.perf_counter(), eng.add_request([7] * 5, greedy(5), "small")
    while not seq.is_finished:
        eng.step()
    return time.perf_counter() - start


def beside_batch(model, n: int, prompt_len: int, grouped: bool | None) -> dict:
    eng = engine(model, max_num_seqs=16, max_num_batched_tokens=1024,
                 max_model_len=prompt_len + 16)
    small_latency(eng)                                   # warm up
    if grouped is None:
        return {"batch": "none", "small_s": small_latency(eng)}
    for i in range(n):
        eng.add_request([(i * 7 + j) % 250 + 1 for j in range(prompt_len)], greedy(4),
                        f"b-{i}", group="batch" if grouped else None)
    while eng.scheduler.pool.num_free:
        eng.step()
    took = small_latency(eng)
    done, start = sum(eng._seqs.get(f"b-{i}") is None for i in range(n)), time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return {"batch": "one request" if grouped else f"{n} requests (FCFS)", "small_s": took,
            "batch_prompts_done_before": done, "batch_rest_s": time.perf_counter() - start}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 2)
    n, plen = (32, 100) if run.args.quick else (256, 300)
    torch.manual_seed(0)
    model, rows = HylaLM(preset("debug")).eval(), []
    for grouped in (None, True, False):
        run.progress(f"batch as one request: {grouped}")
        r = beside_batch(model, n, plen, grouped)
        rows.append({k: round(v, 4 if k == "small_s" else 2) if isinstance(v, float) else v
                     for k, v in r.items()} | {"x_alone": round(r["small_s"] / (
                         rows[0]["small_s"] if rows else r["small_s"]), 1)})
    run.table(f"a 5-token request beside {n} prompts of {plen} tokens", rows)
    run.save(rows, prompts=n, prompt_len=plen, summary=f"a small request {rows[0]['small_s']:.2f}"
             f" s alone, {rows[1]['x_alone']}x that beside a batch as one request, "
             f"{rows[2]['x_alone']}x beside {n} requests served first come first served")
