"""A draft model speeds up a float model and keeps its greedy output (``--speculative
draft:SOURCE``).

The target: SmolLM2-135M-Instruct in float (``--target-quantize``, default ``none``: the
GGUF's Q4_1 weights dequantised, as a user serves a model unquantised for its exact output).
The draft: the same file quantised as ``--draft-quantize`` (default ``auto``: int4 with 8-bit
activations where VNNI runs), so the two share the tokenizer. One thread, one greedy request
at a time, ``--tokens`` tokens, the tasks of ``speculative_decode`` (a repetitive code edit,
a story). The engine (``--compile``: target and draft compiled, as ``hyla serve
--compile``) plain, with n-gram drafts and with the draft model, in alternating rounds:
decode tok/s after the first token (medians), the share of drafts kept, and whether the
tokens are the plain run's. ``generate_*``: the same for ``hyla generate``'s loop (eager).
``--quick``: 48 tokens, 1 round.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.serve_common import decode_rate, served_smollm2
from benchmarks.speculative_decode import TASKS
from hyla.data.tokenizer import stop_ids
from hyla.model.stream import StreamTiming, stream_tokens
from hyla.serve.draft_model import ModelDrafter
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams
from hyla.serve.session import RunnerState


def add_args(p) -> None:
    p.add_argument("--target-quantize", default="none", help="the target's scheme "
                   "(%(default)s)")
    p.add_argument("--target-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the target's dtype (%(default)s; the draft takes it too)")
    p.add_argument("--draft-quantize", default="auto", help="the draft's scheme "
                   "(%(default)s)")
    p.add_argument("--tokens", type=int, default=112, help="tokens a request (%(default)s)")
    p.add_argument("--k", type=int, default=3, help="drafts a step (%(default)s)")
    p.add_argument("--compile", action="store_true", help="target and draft decode through "
                   "torch.compile, as `hyla serve --compile`")


def stream_rate(model, prompt, tokens, drafter, stop):
    """Decode tok/s of ``hyla generate``'s loop, and its tokens."""
    timing = StreamTiming()
    out = list(stream_tokens(model, RunnerState(model), prompt, tokens, temperature=0,
                             stop_ids=stop, timing=timing, drafter=drafter))
    return timing.decode_tok_s, out


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    tokens = 48 if a.quick else a.tokens
    dtype = getattr(torch, a.target_dtype)
    model, tok, target_scheme, _ = served_smollm2(a.target_quantize, dtype)
    draft, _, draft_scheme, _ = served_smollm2(a.draft_quantize, dtype)
    # max_num_seqs 8: the decode widths (1, 2, 4, 8) a compiled verify of k + 1 tokens takes
    common = dict(max_num_seqs=8, max_model_len=1024, compile=a.compile)
    engines = {"plain": Engine(model, tok, EngineConfig(**common)),
               "ngram": Engine(model, tok, EngineConfig(**common, speculative="ngram",
                                                        num_speculative_tokens=a.k)),
               "draft": Engine(model, tok, EngineConfig(**common, speculative="draft:smollm2",
                                                        num_speculative_tokens=a.k),
                               draft_model=draft)}
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
        before = dict(engines["draft"].stats)
        rates = run.rounds({name: lambda e=eng, p=prompt: decode_rate(e, p, tokens, params)
                            for name, eng in engines.items()}, 1 if a.quick else None)
        drafters = {"plain": lambda: None, "draft": lambda: ModelDrafter(draft, a.k)}
        streamed = run.rounds({name: lambda p=prompt, d=d: stream_rate(model, p, tokens, d(),
                                                                      stop)
                               for name, d in drafters.items()}, 1 if a.quick else None)
        st = engines["draft"].stats
        drafts = st["draft_tokens"] - before["draft_tokens"]
        accepted = st["accepted_tokens"] - before["accepted_tokens"]
        speed = {name: statistics.median(r[0] for r in rates[name]) for name in engines}
        gen = {name: statistics.median(r[0] for r in streamed[name]) for name in drafters}
        rows.append({"task": task, "plain_tok_s": speed["plain"],
                     "ngram_tok_s": speed["ngram"], "draft_tok_s": speed["draft"],
                     "ngram_speedup": speed["ngram"] / speed["plain"],
                     "draft_speedup": speed["draft"] / speed["plain"],
                     "draft_accepted": accepted / drafts if drafts else 0,
                     "same_tokens": outs["plain"] == outs["draft"] == outs["ngram"],
                     "tokens": len(outs["plain"]),
                     "generate_plain_tok_s": gen["plain"], "generate_draft_tok_s": gen["draft"],
                     "generate_speedup": gen["draft"] / gen["plain"],
                     "generate_same_tokens": streamed["plain"][0][1] == streamed["draft"][0][1]})
        run.progress(f"{task}: {tok.decode(outs['draft'])[:120]!r}")
    run.table(f"one greedy request, {tokens} tokens, k = {a.k}, target {target_scheme}, "
              f"draft {draft_scheme}, {a.target_dtype}" + ", compiled" * a.compile, rows)
    run.save(rows, name="speculative_draft" + f"_{a.target_dtype}" * (dtype != torch.float32)
             + "_compiled" * a.compile + "_quick" * a.quick, dtype=a.target_dtype,
             target=target_scheme, draft=draft_scheme, k=a.k, compile=a.compile,
             tokens=tokens, summary="; ".join(
                 f"{r['task']}: draft model {r['draft_speedup']:.2f}x ({r['draft_tok_s']:.1f} "
                 f"vs {r['plain_tok_s']:.1f} tok/s, {r['draft_accepted']:.0%} of drafts "
                 f"kept), n-gram {r['ngram_speedup']:.2f}x, tokens "
                 f"{'equal' if r['same_tokens'] else 'DIFFERENT'}; hyla generate "
                 f"{r['generate_speedup']:.2f}x, tokens "
                 f"{'equal' if r['generate_same_tokens'] else 'DIFFERENT'}" for r in rows))
