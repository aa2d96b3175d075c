"""The engine alone on ``vs_llamacpp.py``'s concurrent row: where a served batch's time goes.

16 requests x 64 greedy tokens (the same prompt, numbered) through :class:`Engine` with
SmolLM2-135M int4 (or each scheme ``--quantize`` names, side by side) and compiled decode,
no HTTP: output tokens per second, and the seconds spent in the runner's prefill and decode
calls (by batch size) against the wall time. Set
beside ``vs_llamacpp.py``'s figure through the server, the difference is what serving costs
(HTTP, streaming, the client on the other core). One thread, medians of the rounds.

    python benchmarks/engine_concurrent.py [--rounds 3] [--quantize int4 int4-a8]

Writes benchmarks/results/engine_concurrent.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import time

import torch

from hyla.model.load import load_model
from hyla.model.quantize import SCHEMES, prepare_copies, quantize_model
from hyla.perf import machine_info
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams

RESULTS = pathlib.Path(__file__).parent / "results" / "engine_concurrent.json"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
REQUESTS, TOKENS = 16, 64


def timed(calls: dict[str, float], name_of, method):
    """``method`` wrapped to add its wall time to ``calls[name_of(args)]``."""
    def run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            calls[name_of(args)] += time.perf_counter() - start
    return run


def run_round(engine: Engine, tokenizer, tag: str, calls: dict[str, float]) -> dict:
    calls.clear()
    start = time.perf_counter()
    for i in range(REQUESTS):
        engine.add_request(tokenizer.encode(f"{tag}.{i}. {PROMPT}"),
                           SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    return {"tok_s": REQUESTS * TOKENS / wall, "wall_s": wall, "runner_s": dict(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantize", nargs="+", default=["int4"], choices=SCHEMES[1:],
                        help="one engine per scheme, in alternating rounds (default int4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines, build_s = {}, {}
    for scheme in args.quantize:
        model, tokenizer = load_model("smollm2")
        quantize_model(model, scheme)
        prepare_copies(model)
        engines[scheme] = Engine(model, tokenizer, EngineConfig(
            max_num_seqs=REQUESTS, compile=True, kv_cache_dtype="bfloat16"))
        began = time.perf_counter()
        engines[scheme].warmup()
        build_s[scheme] = time.perf_counter() - began
    calls: dict[str, float] = collections.defaultdict(float)
    Runner.decode = timed(calls, lambda a: f"decode of {len(a[0])}", Runner.decode)
    Runner.prefill = timed(calls, lambda a: "prefill", Runner.prefill)
    rounds: dict[str, list[dict]] = {scheme: [] for scheme in engines}
    for r in range(args.rounds):
        for scheme in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            rounds[scheme].append(run_round(engines[scheme], tokenizer, f"{r}", calls))
            print(scheme, json.dumps(rounds[scheme][-1]), flush=True)
    summary = {scheme: {"tok_s": statistics.median(x["tok_s"] for x in runs),
                        "wall_s": statistics.median(x["wall_s"] for x in runs),
                        "graph_build_s": build_s[scheme]} for scheme, runs in rounds.items()}
    print(json.dumps(summary))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": 1,
                                   "load": os.getloadavg(), "requests": REQUESTS,
                                   "tokens": TOKENS, "median": summary, "rounds": rounds},
                                  indent=1) + "\n")


if __name__ == "__main__":
    main()
