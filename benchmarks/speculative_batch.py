"""N-gram speculative decoding for several requests decoding together.

SmolLM2-135M-Instruct Q4_1 (``--quantize``, default ``auto``) on a compiled engine, one
thread: ``--requests`` greedy requests at once, each asked to rewrite a given Python
function with a different renaming (repetitive), or to write a story on a different subject
(not repetitive); plain decoding against ``--speculative ngram`` (``--k`` drafts), where the
decoding requests' drafts are verified together in one decode batch. Output tokens/s of the
whole batch (wall time from the first step to the last request's end of turn, medians of
alternating rounds), the share of drafts kept, and whether every request's tokens are the
plain engine's. ``--quick``: 1 round.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.serve_common import engine, served_smollm2
from benchmarks.speculative_decode import CODE
from hyla.serve.sequence import SamplingParams

NAMES = ("xs", "data", "series", "samples", "points", "nums", "vals", "items")
SUBJECTS = ("a lighthouse keeper", "a lost robot", "a desert caravan", "a clockmaker",
            "a mountain village", "a deep-sea diver", "a night train", "an old library")


def add_args(p) -> None:
    p.add_argument("--quantize", default="auto", help="the serving scheme (%(default)s)")
    p.add_argument("--requests", type=int, default=4, help="at once (%(default)s)")
    p.add_argument("--tokens", type=int, default=160, help="at most a request (%(default)s)")
    p.add_argument("--k", type=int, default=4, help="drafts a request a step (%(default)s)")


def batch_rate(eng, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, params)
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0), \
        [s.output_ids for s in seqs]


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    model, tok, scheme, _ = served_smollm2(a.quantize)
    common = dict(max_num_seqs=max(8, a.requests), max_model_len=1024, compile=True)
    engines = {"plain": engine(model, tok, **common),
               "ngram": engine(model, tok, **common, speculative="ngram",
                               num_speculative_tokens=a.k)}
    for eng in engines.values():
        eng.warmup()
    params = SamplingParams(max_tokens=a.tokens, temperature=0)
    n = a.requests
    tasks = {
        "repetitive (edit code)": [
            f"Rewrite this function exactly, but rename `values` to `{NAMES[i % 8]}`. Reply "
            f"with the code only.\n\n{CODE}" for i in range(n)],
        "not repetitive (stories)": [
            f"Write a short story about {SUBJECTS[i % 8]}." for i in range(n)],
    }
    rows = []
    for task, texts in tasks.items():
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
                   for t in texts]
        outs = {name: batch_rate(eng, prompts, params)[1] for name, eng in engines.items()}
        before = dict(engines["ngram"].stats)
        rates = run.rounds({name: lambda e=eng, ps=prompts: batch_rate(e, ps, params)
                            for name, eng in engines.items()}, 1 if a.quick else None)
        st = engines["ngram"].stats
        drafts = st["draft_tokens"] - before["draft_tokens"]
        kept = st["accepted_tokens"] - before["accepted_tokens"]
        plain = statistics.median(r[0] for r in rates["plain"])
        spec = statistics.median(r[0] for r in rates["ngram"])
        rows.append({"task": task, "requests": n, "plain_tok_s": plain, "ngram_tok_s": spec,
                     "speedup": spec / plain, "accepted": kept / drafts if drafts else 0.0,
                     "same_tokens": outs["plain"] == outs["ngram"],
                     "tokens": sum(map(len, outs["plain"]))})
        run.progress(f"{task}: {rows[-1]['speedup']:.2f}x")
    run.table(f"{n} requests at once, k = {a.k}, {scheme}, compiled", rows)
    run.save(rows, scheme=scheme, k=a.k, requests=n, summary="; ".join(
        f"{r['task']}: {r['speedup']:.2f}x ({r['ngram_tok_s']:.1f} vs {r['plain_tok_s']:.1f} "
        f"tok/s), {r['accepted']:.0%} of drafts kept, tokens "
        f"{'equal' if r['same_tokens'] else 'DIFFERENT'}" for r in rows))
