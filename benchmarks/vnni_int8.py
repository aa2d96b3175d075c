"""fbgemm's int8 products (hyla.model.vnni_int8) beat torch's weight-only kernels, VNNI or AVX2.

On a VNNI CPU the activations' grid is 8 bits, on AVX2 alone 7 (the results say which).
SmolLM2-135M int4, one thread, alternating rounds, medians: the output layer (49,152 x 576) at 1
and 16 rows; the decode path (16 held-out documents x 128 tokens, teacher-forced) with the
products off, on, and on 8-bit activations (no residual row). ``--quick``: 4 x 16 tokens.
"""

import itertools
import math
import statistics
import time

import torch

from hyla.data.corpus import iter_documents
from hyla.model import quantize as Q
from hyla.model.load import load_model
from hyla.model.vnni_int8 import activation_levels, int8_products_available
from hyla.serve.runner import Runner


def int4_smollm2(run) -> tuple[torch.nn.Module, list[list[int]]]:
    """SmolLM2-135M int4 on one thread, held-out documents; exits where fbgemm does not run."""
    if not int8_products_available():
        raise SystemExit("this CPU has no AVX2 (or torch no fbgemm): nothing to compare")
    torch.set_num_threads(run.args.threads or 1)
    model, tokenizer = load_model("smollm2")
    Q.quantize_model(model, "int4")
    n, tokens = (4, 16) if run.args.quick else (16, 128)
    texts = map(tokenizer.encode, iter_documents(None, "validation"))
    docs = list(itertools.islice((ids[:tokens + 2] for ids in texts if len(ids) > tokens + 1), n))
    return model, docs


def decode(model, docs) -> tuple[float, float, list[float]]:
    """``docs`` decoded together, teacher-forced: (perplexity, tokens/s, seconds a step)."""
    n, tokens, blocks = len(docs), len(docs[0]) - 2, (len(docs[0]) - 2) // 16 + 2
    runner = Runner(model, max_num_seqs=n, num_kv_blocks=n * blocks + 1, kv_dtype=torch.bfloat16)
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(n)]
    for j, doc in enumerate(docs):
        runner.prefill([(j, doc[:1], 0, tables[j])])
    nll, steps = 0.0, []
    for i in range(1, tokens + 1):
        start = time.perf_counter()
        logits = runner.decode(list(range(n)), [d[i] for d in docs], [i] * n, tables, width=n)
        steps.append(time.perf_counter() - start)
        nll -= sum(logits[j].log_softmax(-1)[d[i + 1]].item() for j, d in enumerate(docs))
    return math.exp(nll / n / tokens), n / statistics.median(steps), steps


def case(run, model, docs, mode: str) -> dict[str, float]:
    """The output layer ("layer"), or the decode path in ``mode``."""
    Q.int8_products_available = (int8_products_available if mode != "off"
                                 else (lambda: False))
    for m in model.modules():
        if isinstance(m, Q.WeightOnlyLinear):
            m.vnni_matmul().residual = "8-bit" not in mode   # the default: a residual row
    if mode != "layer":
        ones, (ppl, tok_s, _) = [decode(model, [doc]) for doc in docs], decode(model, docs)
        return {"ms per token, 1 sequence": 1e3 * statistics.median(t for *_, s in ones for t in s),
                "perplexity, width 1": statistics.geometric_mean(p for p, *_ in ones),
                "perplexity, width 16": ppl, "tokens/s, 16 sequences": tok_s}
    head = model.lm_head                                     # int8 codes, one scale a row
    vnni, dense = head.vnni_matmul(), head.dequantized(torch.bfloat16)
    groups = Q.Int8GroupLinear(head.dequantized(), None)    # the form without VNNI, 8 bits
    x1, x16 = torch.randn(1, 576), torch.randn(16, 576)
    return {k: 1e3 * run.median(fn, repeats=30) for k, fn in {
        "torch int8 kernel, 1 row": lambda: head._kernel(x1.bfloat16()),
        "two int4 passes, 1 row": lambda: groups._kernel(x1.bfloat16()),
        "fbgemm int8, 1 row": lambda: vnni(x1),
        "two int4 passes, 16 rows": lambda: groups._kernel(x16.bfloat16()),
        "bf16 dense, 16 rows": lambda: torch.nn.functional.linear(x16.bfloat16(), dense),
        "fbgemm int8, 16 rows": lambda: vnni(x16)}.items()}


def main(run) -> None:
    model, docs = int4_smollm2(run)
    runs = run.rounds({m: lambda m=m: case(run, model, docs, m) for m in ("layer", "off", "on",
                                                                  "on, 8-bit activations")})
    rows = [{"what": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
            for name, rs in runs.items()]
    run.table("medians (ms, tokens/s, perplexity)", rows)
    layer, tok_s = rows[0], " / ".join(f"{r['tokens/s, 16 sequences']:.0f}" for r in rows[1:])
    run.save(rows, runs=runs, documents=len(docs), activation_levels=activation_levels(),
             summary=f"output layer, 1 row: fbgemm "
             f"{layer['fbgemm int8, 1 row']:.2f} ms vs {layer['two int4 passes, 1 row']:.2f}; "
             f"16 sequences, products off / on / 8-bit: {tok_s} tok/s")
