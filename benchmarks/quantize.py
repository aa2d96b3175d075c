"""Weight-only int8 and int4 keep SmolLM2-135M's perplexity and speed up its decode on a CPU.

Per scheme (none: the GGUF in fp32), one thread: held-out perplexity (16,384 tokens), weights'
bytes, decode tokens/s (64 steps) and prefill tokens/s (1,024 tokens) in alternating rounds,
medians. ``--quick``: 1,024 tokens scored, 8 steps, 128 tokens of prefill.
"""

import copy
import pathlib
import statistics
import time

import torch

from hyla.eval.perplexity import perplexity
from hyla.model.load import load_model
from hyla.model.quantize import quantize_model


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    base, tok = load_model("smollm2")     # its error says how to install the package
    quick, models, rows = run.args.quick, {}, []
    for scheme in ("none", "int8", "int4"):
        model = models[scheme] = copy.deepcopy(base) if scheme != "none" else base
        report = quantize_model(model, scheme)
        ppl = perplexity(model, tok, seq_len=512, max_tokens=1024 if quick else 16384)
        rows.append({"scheme": scheme, "tokens_scored": ppl["tokens"],
                     "weight_bytes": report.bytes_after, "perplexity": ppl["perplexity"]})
    prompt = torch.tensor(tok.encode('def fibonacci(n):\n    """Return the'))
    text = torch.tensor(tok.encode(pathlib.Path(copy.__file__).read_text(encoding="utf-8")))
    long_prompt, steps = text[:128 if quick else 1024], 8 if quick else 64

    def speeds(model) -> tuple[float, float]:
        state = model.new_state()
        token = model.prefill(prompt, state)[-1].argmax().view(1)
        start = time.perf_counter()
        for _ in range(steps):
            token = model.decode(token, [state])[0].argmax().view(1)
        decode, start = steps / (time.perf_counter() - start), time.perf_counter()
        model.prefill(long_prompt, model.new_state())
        return decode, len(long_prompt) / (time.perf_counter() - start)

    runs = run.rounds({s: lambda m=m: speeds(m) for s, m in models.items()})
    for row in rows:
        row["decode_tok_s"], row["prefill_tok_s"] = map(statistics.median,
                                                        zip(*runs[row["scheme"]], strict=True))
        row |= {f"{k}_ratio": row[k] / rows[0][k] for k in list(row)[2:]}
    run.table("weight-only quantisation, SmolLM2-135M-Instruct (ratios: to fp32)", rows)
    run.save(rows, runs=runs, decode_steps=steps, summary="vs fp32, int8 / int4: perplexity "
             + " / ".join(f"{r['perplexity_ratio']:.3f}x" for r in rows[1:]) + ", decode "
             + " / ".join(f"{r['decode_tok_s_ratio']:.2f}x" for r in rows[1:]))
