"""Sampling 16 rows costs a few ms, not a third of a decode step.

The sampler (``hyla.model.sampler.sample``) draws a token by inverting the cumulative sum
at one uniform number, and finds top-p's nucleus among the 1,024 likeliest tokens before it
sorts a whole vocabulary; the obvious form (``reference_sample`` below: ``torch.multinomial``,
which draws a random number per vocabulary entry, and a full sort for top-p) is what hyla
ran before. Both on 16 rows of SmolLM2-135M-Instruct's own logits (over a stdlib source
file, with the engine's weights), temperature 0.8, top-p 1.0 and 0.95, one thread, medians
of ``--repeats``;
then 16 concurrent sampled requests x 64 tokens through a compiled engine (int4-a8, or
``--quantize``) with each sampler: the decode step's median time.
``--quick``: fewer repeats, 24 tokens.
"""

import json
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.serve_common import PROMPT, engine, served_smollm2
from hyla.model.sampler import filter_logits, is_greedy, sample
from hyla.serve.sequence import SamplingParams


def add_args(p) -> None:
    p.add_argument("--quantize", default="auto", help="the engine's scheme (%(default)s)")


def reference_sample(logits, params, generators):
    """The obvious sampler: a full sort for top-p, ``torch.multinomial`` for the draw."""
    tokens = logits.max(dim=-1).indices.tolist()
    for b, p in enumerate(params):
        if is_greedy(p.temperature):
            continue
        row = logits[b].double()
        if p.top_p < 1.0:
            s, order = torch.sort(row, descending=True)
            probs = torch.softmax(s, -1)
            row = row.clone()
            row[order[probs.cumsum(-1) - probs >= p.top_p]] = float("-inf")
        row = filter_logits(row, p.top_k, 1.0) / p.temperature
        tokens[b] = int(torch.multinomial(torch.softmax(row, -1), 1, generator=generators[b]))
    return tokens, [None] * len(params)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    repeats = 5 if a.quick else (a.repeats or 20)
    model, tok, scheme, _ = served_smollm2(a.quantize)
    ids = tok.encode(open(json.__file__).read()[:2000])[:256]
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()[-16:]
    rows = []
    for top_p in (1.0, 0.95):
        params = [SimpleNamespace(temperature=0.8, top_k=0, top_p=top_p, logprobs=None)] * 16
        new = median_ms(lambda p=params: sample(logits, p, [None] * 16), repeats)
        old = median_ms(lambda p=params: reference_sample(logits, p, [None] * 16), repeats)
        rows.append({"what": f"sample 16 rows, top_p {top_p}", "hyla_ms": new,
                     "reference_ms": old, "speedup": old / new})
    tokens = 24 if a.quick else 64
    params = SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{i}. {PROMPT}"}],
                                       tokenize=True) for i in range(16)]
    steps = {}
    for name, sampler in (("hyla", sample), ("reference", reference_sample)):
        eng = engine(model, tok, max_num_seqs=16, max_model_len=1024, compile=True,
                     sampler=sampler)
        eng.warmup()
        eng.generate(prompts, params)                   # warm-up
        times = []
        for p in prompts:
            eng.add_request(p, params)
        while eng.has_unfinished():
            t = time.perf_counter()
            outs = eng.step()
            if len(outs) == 16 and not any(o.finished for o in outs):
                times.append(time.perf_counter() - t)
        steps[name] = 1e3 * statistics.median(times)
        run.progress(f"{name}: 16-wide sampled decode step {steps[name]:.1f} ms")
    rows.append({"what": f"16-wide sampled decode step, compiled, {scheme}",
                 "hyla_ms": steps["hyla"], "reference_ms": steps["reference"],
                 "speedup": steps["reference"] / steps["hyla"]})
    run.table("sampling, SmolLM2-135M, temperature 0.8", rows)
    run.save(rows, name="sampler" + "_quick" * a.quick, scheme=scheme, summary="; ".join(
        f"{r['what']}: {r['hyla_ms']:.1f} ms against {r['reference_ms']:.1f} "
        f"({r['speedup']:.2f}x)" for r in rows))
