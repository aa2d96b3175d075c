"""The engine alone serves 16 concurrent requests faster than through hyla serve's HTTP.

16 requests x 64 greedy tokens through the Engine, SmolLM2-135M per ``--quantize`` scheme
(alternating ``--rounds``), compiled, bf16 KV: output tok/s, and seconds in the runner's
prefill and decode calls (by width). ``--quick``: eager, one round.
"""

import collections
import itertools
import statistics
import time

import torch

from benchmarks.serve_common import PROMPT, engine, greedy
from hyla.model.load import load_model
from hyla.model.quantize import SCHEMES, prepare_copies, quantize_model
from hyla.serve.runner import Runner

REQUESTS, TOKENS = 16, 64


def add_args(parser) -> None:
    parser.add_argument("--quantize", nargs="+", default=["int4"], choices=SCHEMES[1:],
                        help="one engine a scheme, in alternating rounds (default int4)")


def timed(calls: dict[str, float], key, method):
    """``method`` adding its seconds to ``calls[key(args)]``."""
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            calls[key(args)] += time.perf_counter() - start
    return wrapper


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    engines, build_s, calls = {}, {}, collections.defaultdict(float)
    for scheme in run.args.quantize:
        run.progress(f"{scheme}: load, quantise, warm up")
        model, tokenizer = load_model("smollm2")
        quantize_model(model, scheme)
        prepare_copies(model)
        engines[scheme] = engine(model, tokenizer, max_num_seqs=REQUESTS,
                                 compile=not run.args.quick, kv_cache_dtype="bfloat16")
        began = time.perf_counter()
        engines[scheme].warmup()
        build_s[scheme] = time.perf_counter() - began
    Runner.decode = timed(calls, lambda a: f"decode of {len(a[0])}", Runner.decode)
    Runner.prefill = timed(calls, lambda a: "prefill", Runner.prefill)
    count = itertools.count()

    def one_round(eng) -> dict:
        calls.clear()
        tag, start = next(count) // len(engines), time.perf_counter()
        for i in range(REQUESTS):       # the round's tag keeps the prefix cache out of it
            eng.add_request(tokenizer.encode(f"{tag}.{i}. {PROMPT}"), greedy(TOKENS))
        while eng.has_unfinished():
            eng.step()
        wall = time.perf_counter() - start
        return {"tok_s": REQUESTS * TOKENS / wall, "wall_s": wall, "runner_s": dict(calls)}

    runs = run.rounds({s: lambda e=e: one_round(e) for s, e in engines.items()},
                      1 if run.args.quick else None)
    rows = [{"quantize": s, "graph_build_s": build_s[s], **{k: statistics.median(
        x[k] for x in rs) for k in ("tok_s", "wall_s")}} for s, rs in runs.items()]
    run.table(f"{REQUESTS} requests x {TOKENS} tokens through the engine, medians", rows)
    run.save(rows, rounds=runs, compile=not run.args.quick, summary=", ".join(
        f"{r['quantize']} {r['tok_s']:.0f} tok/s" for r in rows) + " (16 x 64 tokens, engine)")
