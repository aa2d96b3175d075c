"""N-gram speculative decoding speeds up a repetitive task and keeps the greedy output.

SmolLM2-135M-Instruct Q4_1 (``--quantize``, default ``auto``), the engine alone, one thread,
one greedy request at a time, ``--tokens`` tokens each. Repetitive: the chat model asked to
rewrite a given Python function with one change (it copies most of it). Not repetitive: asked
to write a short story. Plain decoding against ``--speculative ngram`` with ``--k`` drafts,
in alternating rounds, decode tok/s after the first token (medians), the share of drafts
accepted, and whether the tokens are the plain run's. A request ends at the model's end of
turn, as a user's would (SmolLM2 copies the function's first half, then ends): past it,
``ignore_eos`` measured made-up chat turns, not the task.
The same for ``hyla generate``'s and ``hyla chat``'s loop (``stream_tokens`` over a
``RunnerState``, ``--speculative ngram``): the ``generate_*`` columns.
``--quick``: 48 tokens, 1 round.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.serve_common import decode_rate, engine, served_smollm2
from hyla.data.tokenizer import stop_ids
from hyla.model.stream import StreamTiming, stream_tokens
from hyla.serve.sequence import SamplingParams
from hyla.serve.session import RunnerState
from hyla.serve.speculative import NgramDrafter

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
TASKS = {
    "repetitive (edit code)": "Rewrite this function exactly, but rename `values` to `xs`. "
                              "Reply with the code only.\n\n" + CODE,
    "not repetitive (story)": "Write a short story about a lighthouse keeper and a storm.",
}


def add_args(p) -> None:
    p.add_argument("--quantize", default="auto", help="the serving scheme (%(default)s)")
    p.add_argument("--tokens", type=int, default=112, help="tokens a request (%(default)s: "
                   "about the edited function's length)")
    p.add_argument("--k", type=int, default=4, help="drafts a step (%(default)s)")
    p.add_argument("--compile", action="store_true", help="the engines decode through "
                   "torch.compile, as `hyla serve` does by default (the drafts are then "
                   "verified as a compiled decode batch where the model has no fixed-size "
                   "state)")


def stream_rate(model, prompt: list[int], tokens: int, k: int | None, stop: tuple[int, ...]):
    """Decode tok/s of ``hyla generate``'s loop, and its tokens (``k``: with n-gram drafts)."""
    timing = StreamTiming()
    out = list(stream_tokens(model, RunnerState(model), prompt, tokens, temperature=0,
                             stop_ids=stop, timing=timing,
                             drafter=NgramDrafter(k) if k else None))
    return timing.decode_tok_s, out


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    tokens = 48 if a.quick else a.tokens
    model, tok, scheme, _ = served_smollm2(a.quantize)
    # max_num_seqs 8: the decode widths (1, 2, 4, 8) a compiled verify of k + 1 tokens takes
    common = dict(max_num_seqs=8, max_model_len=1024, compile=a.compile)
    engines = {"plain": engine(model, tok, **common),
               "ngram": engine(model, tok, **common, speculative="ngram",
                               num_speculative_tokens=a.k)}
    for eng in engines.values():
        eng.warmup()
    params = SamplingParams(max_tokens=tokens, temperature=0)
    stop = stop_ids(tok)
    rows = []
    for task, text in TASKS.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        outs = {}
        for name, eng in engines.items():
            (seq,) = eng.generate([prompt], params)      # warm-up; the tokens
            outs[name] = seq.output_ids
        before = dict(engines["ngram"].stats)
        rates = run.rounds({name: lambda e=eng, p=prompt: decode_rate(e, p, tokens, params)
                            for name, eng in engines.items()}, 1 if a.quick else None)
        streamed = run.rounds({name: lambda p=prompt, k=k: stream_rate(model, p, tokens, k, stop)
                               for name, k in (("plain", None), ("ngram", a.k))},
                              1 if a.quick else None)
        st = engines["ngram"].stats
        drafts = st["draft_tokens"] - before["draft_tokens"]
        accepted = st["accepted_tokens"] - before["accepted_tokens"]
        plain = statistics.median(r[0] for r in rates["plain"])
        spec = statistics.median(r[0] for r in rates["ngram"])
        rows.append({"task": task, "plain_tok_s": plain, "ngram_tok_s": spec,
                     "speedup": spec / plain, "accepted": accepted / drafts if drafts else 0,
                     "same_tokens": outs["plain"] == outs["ngram"],
                     "tokens": len(outs["plain"]),
                     "generate_plain_tok_s": statistics.median(r[0] for r in streamed["plain"]),
                     "generate_ngram_tok_s": statistics.median(r[0] for r in streamed["ngram"]),
                     "generate_same_tokens": streamed["plain"][0][1] == streamed["ngram"][0][1]})
        rows[-1]["generate_speedup"] = (rows[-1]["generate_ngram_tok_s"]
                                        / rows[-1]["generate_plain_tok_s"])
        run.progress(f"{task}: {tok.decode(outs['ngram'])[:120]!r}")
    run.table(f"one greedy request, {tokens} tokens, k = {a.k}, {scheme}"
              + ", compiled" * a.compile, rows)
    run.save(rows, name="speculative_decode" + "_compiled" * a.compile + "_quick" * a.quick,
             scheme=scheme, k=a.k, compile=a.compile,
             tokens=tokens, summary="; ".join(
                 f"{r['task']}: {r['speedup']:.2f}x ({r['ngram_tok_s']:.1f} vs "
                 f"{r['plain_tok_s']:.1f} tok/s), {r['accepted']:.0%} of drafts accepted, "
                 f"tokens {'equal' if r['same_tokens'] else 'DIFFERENT'}; hyla generate "
                 f"{r['generate_speedup']:.2f}x, tokens "
                 f"{'equal' if r['generate_same_tokens'] else 'DIFFERENT'}" for r in rows))
