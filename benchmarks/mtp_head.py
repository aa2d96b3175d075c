"""A self-distilled MTP head makes SmolLM2 draft for itself (``--speculative mtp``), and the
greedy output stays its own.

SmolLM2-135M-Instruct (float32, the GGUF's Q4_1 weights dequantised) gets a fresh MTP head
(:func:`hyla.train.mtp_head.with_mtp_head`: one block, a copy of its last), trained for
``--steps`` steps of ``--batch`` rows of ``--seq`` tokens on the model's own distributions
(:func:`~hyla.train.mtp_head.mtp_distill_step`): windows of the standard library's source
and of the model's own greedy answers to a few chat prompts (none of them the tasks below),
their hidden states computed once and reused by every step.
Then one thread, one greedy request at a time, the tasks of ``speculative_decode`` (a
repetitive code edit, a story): the engine plain, with n-gram drafts, with MTP drafts
(k = ``--k``) and with MTP drafts cut off under ``--confidence``, in alternating rounds:
decode tok/s after the first token (medians), the share of drafts kept, and whether the
tokens are the plain run's. A trained head is kept in ``~/.cache/hyla/mtp_head`` by its
settings and reused (``--retrain``: not). ``--quick``: 20 steps, 48 tokens, 1 round.
"""

from __future__ import annotations

import pathlib
import random
import statistics
import time

import torch
from safetensors.torch import load_file, save_file

from benchmarks.serve_common import decode_rate, served_smollm2
from benchmarks.speculative_decode import TASKS
from hyla.data.corpus import stdlib_files
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams
from hyla.train.mtp_head import mtp_distill_step, with_mtp_head

PROMPTS = ["Explain what a Python list comprehension is, with an example.",
           "Write a Python function that checks whether a string is a palindrome.",
           "What causes the seasons on Earth?",
           "Give three tips for writing clear emails.",
           "Write a haiku about autumn leaves.",
           "Describe how a bicycle works in a few sentences.",
           "Write a function that returns the n-th Fibonacci number.",
           "Why is the sky blue?"]


def add_args(p) -> None:
    p.add_argument("--steps", type=int, default=300, help="training steps (%(default)s)")
    p.add_argument("--batch", type=int, default=4, help="rows a step (%(default)s)")
    p.add_argument("--seq", type=int, default=128, help="tokens a row (%(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's (%(default)s)")
    p.add_argument("--tokens", type=int, default=112, help="tokens a request (%(default)s)")
    p.add_argument("--k", type=int, default=3, help="drafts a step (%(default)s)")
    p.add_argument("--confidence", type=float, default=0.5, help="the mtp-confident row's "
                   "cut-off: no draft the head gives a probability under it (%(default)s)")
    p.add_argument("--retrain", action="store_true", help="train the head even where one "
                   "of these settings is saved (~/.cache/hyla/mtp_head)")


def windows(tok, model, seq: int, rng: random.Random) -> list[list[int]]:
    """Training rows: stdlib source windows and the model's own answers (with prompts)."""
    rows = []
    for path in rng.sample(stdlib_files("train"), 40):
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
        rows += [ids[i:i + seq] for i in range(0, len(ids) - seq, seq)][:20]
    plain = Engine(model, tok, EngineConfig(max_model_len=1024))
    for text in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        (s,) = plain.generate([prompt], SamplingParams(max_tokens=2 * seq, temperature=0))
        ids = prompt + s.output_ids
        rows += [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq // 2)] * 4
    return rows


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    steps, tokens = (20, 48) if a.quick else (a.steps, a.tokens)
    model, tok, scheme, _ = served_smollm2("none", torch.float32)
    rng = random.Random(0)
    t0 = time.perf_counter()
    rows = windows(tok, model, a.seq, rng)
    data_s = time.perf_counter() - t0
    model = with_mtp_head(model)
    saved = pathlib.Path.home() / ".cache" / "hyla" / "mtp_head" / \
        f"smollm2-s{steps}-b{a.batch}-t{a.seq}-lr{a.lr:g}.safetensors"
    train_s, losses = 0.0, []
    if saved.is_file() and not a.retrain:
        model.mtp.load_state_dict(load_file(str(saved)))
        run.progress(f"the head trained before: {saved}")
    else:
        opt = torch.optim.AdamW(model.mtp.parameters(), lr=a.lr)
        torch.set_num_threads(a.threads or 2)        # training: both cores of this machine
        t0 = time.perf_counter()
        rows = [r for r in rows if len(r) == a.seq]
        rows = rng.sample(rows, 64) if a.quick else rows
        ids = torch.tensor(rows)
        with torch.no_grad():       # the model's hidden states, once: a step reuses them
            hidden = torch.cat([model(ids[i:i + 16], hidden=True)
                                for i in range(0, len(ids), 16)])
        run.progress(f"hidden states of {len(rows)} rows: {time.perf_counter() - t0:.0f} s")
        for step in range(steps):
            pick = torch.tensor(rng.sample(range(len(rows)), a.batch))
            losses.append(mtp_distill_step(model, ids[pick], opt, hidden[pick]))
            if step % 50 == 0:
                run.progress(f"step {step}: KL {losses[-1]:.3f}")
        train_s = time.perf_counter() - t0
        saved.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.mtp.state_dict().items()}, str(saved))
    model.eval()
    torch.set_num_threads(a.threads or 1)
    common = dict(max_num_seqs=8, max_model_len=1024)
    engines = {"plain": Engine(model, tok, EngineConfig(**common)),
               "ngram": Engine(model, tok, EngineConfig(**common, speculative="ngram",
                                                        num_speculative_tokens=a.k)),
               "mtp": Engine(model, tok, EngineConfig(**common, speculative="mtp",
                                                      num_speculative_tokens=a.k)),
               "mtp_confident": Engine(model, tok, EngineConfig(
                   **common, speculative="mtp", num_speculative_tokens=a.k,
                   draft_confidence=a.confidence))}
    params = SamplingParams(max_tokens=tokens, temperature=0)
    out_rows = []
    for task, text in TASKS.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        outs = {name: eng.generate([prompt], params)[0].output_ids
                for name, eng in engines.items()}
        before = {name: dict(eng.stats) for name, eng in engines.items()}
        rates = run.rounds({name: lambda e=eng, p=prompt: decode_rate(e, p, tokens, params)
                            for name, eng in engines.items()}, 1 if a.quick else None)
        speed = {name: statistics.median(r[0] for r in rates[name]) for name in engines}
        row = {"task": task, "plain_tok_s": speed["plain"]}
        for name in ("ngram", "mtp", "mtp_confident"):
            st, was = engines[name].stats, before[name]
            drafts = st["draft_tokens"] - was["draft_tokens"]
            row |= {f"{name}_speedup": speed[name] / speed["plain"],
                    f"{name}_kept": (st["accepted_tokens"] - was["accepted_tokens"]) / drafts
                    if drafts else 0.0}
        out_rows.append(row | {"same_tokens": all(o == outs["plain"] for o in outs.values()),
                               "tokens": len(outs["plain"])})
        run.progress(f"{task}: {tok.decode(outs['mtp'])[:120]!r}")
    kl = (f"KL {losses[0]:.2f} -> {statistics.median(losses[-20:]):.2f}" if losses
          else "trained before")
    run.table(f"SmolLM2 float32 with a self-distilled MTP head ({steps} steps x {a.batch} x "
              f"{a.seq} tokens, {train_s:.0f} s, {kl}; data {data_s:.0f} s), one greedy "
              f"request, {tokens} tokens, k = {a.k}, mtp_confident: cut-off "
              f"{a.confidence}", out_rows)
    run.save(out_rows, name="mtp_head" + "_quick" * a.quick, target=scheme, k=a.k,
             steps=steps, train_s=train_s, kl=kl, confidence=a.confidence, tokens=tokens,
             summary="; ".join(
                 f"{r['task']}: MTP {r['mtp_speedup']:.2f}x ({r['mtp_kept']:.0%} of drafts "
                 f"kept), with a {a.confidence} cut-off {r['mtp_confident_speedup']:.2f}x, "
                 f"n-gram {r['ngram_speedup']:.2f}x, tokens "
                 f"{'equal' if r['same_tokens'] else 'DIFFERENT'}" for r in out_rows))
