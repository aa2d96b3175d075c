"""What a compiled engine's verify of n-gram drafts costs against a plain decode step.

SmolLM2-135M-Instruct (``--quantize``, default ``auto``: int4-a8) on a compiled engine with
``--speculative ngram``, one thread: a plain one-token step, then a verify of 2 and 4 tokens
(the last sampled token and its drafts) as the engine runs it (``Runner.verify`` with the
decode widths: a decode batch of the one sequence; quantised, in one row's products,
``one_row_products``) and as an eager prefill chunk (what quantised models ran before, and
what models with fixed-size states run). Medians of 15 (or ``--repeats``). A verify of n tokens pays
where it costs less than the n plain steps its kept drafts replace.
``--quick``: fewer repeats.
"""

import torch

from benchmarks.serve_common import engine, served_smollm2


def add_args(p) -> None:
    p.add_argument("--quantize", default="auto", help="the engine's scheme (%(default)s)")


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    repeats = max(a.repeats, 3 if a.quick else 15)     # steps are short: more than 3
    model, tok, scheme, _ = served_smollm2(a.quantize)
    eng = engine(model, tok, max_num_seqs=8, max_model_len=1024, compile=True,
                 speculative="ngram", num_speculative_tokens=4)
    eng.warmup()
    r, widths = eng.runner, eng.scheduler.config.decode_widths
    table, start = list(range(8)), 40        # slot 0, 40 tokens in (rows past them unread)
    plain = run.median(lambda: r.decode([0], [5], [start], [table], 1), repeats=repeats)
    rows = [{"tokens": 1, "how": "plain decode step", "ms": 1e3 * plain, "plain_steps": 1.0}]
    for n in (2, 4):
        for how, w in (("as the engine verifies", widths), ("as an eager prefill chunk", ())):
            t = run.median(lambda n=n, w=w: r.verify(0, [5] * n, start, table, w),
                           repeats=repeats)
            rows.append({"tokens": n, "how": how, "ms": 1e3 * t, "plain_steps": t / plain})
    run.table(f"verify cost, {scheme}, compiled, one thread", rows)
    run.save(rows, scheme=scheme, summary="; ".join(
        f"{x['tokens']} tokens {x['how']}: {x['ms']:.1f} ms ({x['plain_steps']:.2f} plain "
        "steps)" for x in rows))
