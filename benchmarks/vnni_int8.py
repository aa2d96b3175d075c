"""What fbgemm's VNNI int8 products (hyla.model.vnni_int8) buy and cost on SmolLM2-135M, int4.

Side by side in one process, one thread, alternating rounds, medians:
- the output layer alone (49,152 x 576): torch's weight-only kernels (its int8 kernel, and
  two int4 passes of 8 bits in groups, the form used without VNNI) and the bf16 dense GEMM
  they hand over to from 8 rows, against fbgemm's int8 products, at 1 and 16 rows;
- the decode path through the engine's runner, with the VNNI products off (weight-only
  kernels everywhere) and on (the output layer from one row, every layer from two): ms a
  token for one sequence, tokens/s for 16 decoding together, and the teacher-forced
  perplexity of 16 held-out documents x 128 tokens scored one token a step, at width 1 and
  at width 16 (what the activation quantisation would cost, if it cost anything); and the
  same with the VNNI products on 8-bit activations (no residual row: half their work).

    python benchmarks/vnni_int8.py [--rounds 3]

Writes benchmarks/results/vnni_int8.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import time

import torch

from hyla.data.corpus import iter_documents
from hyla.model import quantize as Q
from hyla.model.load import load_model
from hyla.model.vnni_int8 import vnni_int8_available
from hyla.perf import machine_info
from hyla.serve.runner import Runner

RESULTS = pathlib.Path(__file__).parent / "results" / "vnni_int8.json"
DOCS, TOKENS = 16, 128


def median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def use_vnni(on: bool) -> None:
    """Switch the VNNI products on or off for every quantised layer."""
    Q.vnni_int8_available = vnni_int8_available if on else (lambda: False)


def use_residual(model, on: bool) -> None:
    """16-bit activations (a residual row) or 8-bit ones in every VNNI product."""
    for m in model.modules():
        if isinstance(m, Q.WeightOnlyLinear):
            m.vnni_matmul().residual = on


def output_layer(model) -> dict[str, float]:
    head = model.lm_head                                     # int8 codes, one scale a row
    head(torch.randn(1, 576))                                # packs fbgemm's copy
    vnni = head.__dict__["_vnni"]
    groups = Q.Int8GroupLinear(head.dequantized(), None)    # the int4-kernel form, 8 bits
    dense = head.dequantized(torch.bfloat16)
    x1, x16 = torch.randn(1, 576), torch.randn(16, 576)
    return {
        "torch int8 kernel, 1 row": median_ms(lambda: head._kernel(x1.bfloat16())),
        "two int4 passes, 1 row": median_ms(lambda: groups._kernel(x1.bfloat16())),
        "fbgemm int8, 1 row": median_ms(lambda: vnni(x1)),
        "two int4 passes, 16 rows": median_ms(lambda: groups._kernel(x16.bfloat16())),
        "bf16 dense, 16 rows": median_ms(lambda: torch.nn.functional.linear(x16.bfloat16(),
                                                                             dense)),
        "fbgemm int8, 16 rows": median_ms(lambda: vnni(x16)),
    }


def documents(tokenizer) -> list[list[int]]:
    docs = []
    for text in iter_documents(None, "validation"):
        ids = tokenizer.encode(text)
        if len(ids) >= TOKENS + 2:
            docs.append(ids[:TOKENS + 2])
        if len(docs) == DOCS:
            return docs
    raise SystemExit(f"the held-out split has fewer than {DOCS} documents of {TOKENS} tokens")


def decode_path(model, docs) -> dict[str, float]:
    """Teacher-forced decode of ``docs``: one at a time, then all together."""
    blocks = TOKENS // 16 + 2
    one = Runner(model, max_num_seqs=1, num_kv_blocks=blocks + 1, kv_dtype=torch.bfloat16)
    table = list(range(blocks))
    nll, steps = 0.0, []
    for doc in docs:
        one.prefill([(0, doc[:1], 0, table)])
        for i in range(1, TOKENS + 1):
            start = time.perf_counter()
            logits = one.decode([0], [doc[i]], [i], [table], width=1)[0]
            steps.append(time.perf_counter() - start)
            nll -= logits.log_softmax(-1)[doc[i + 1]].item()
    out = {"ms per token, 1 sequence": 1e3 * statistics.median(steps),
           "perplexity, width 1": math.exp(nll / (DOCS * TOKENS))}
    out["perplexity, width 16"], out["tokens/s, 16 sequences"] = decode_together(model, docs)
    return out


def decode_together(model, docs) -> tuple[float, float]:
    """(perplexity, tokens/s) of ``docs`` decoded together, teacher-forced."""
    blocks = TOKENS // 16 + 2
    wide = Runner(model, max_num_seqs=DOCS, num_kv_blocks=DOCS * blocks + 1,
                  kv_dtype=torch.bfloat16)
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(DOCS)]
    for j, doc in enumerate(docs):
        wide.prefill([(j, doc[:1], 0, tables[j])])
    nll, steps = 0.0, []
    for i in range(1, TOKENS + 1):
        start = time.perf_counter()
        logits = wide.decode(list(range(DOCS)), [d[i] for d in docs], [i] * DOCS, tables,
                             width=DOCS)
        steps.append(time.perf_counter() - start)
        logp = logits.log_softmax(-1)
        nll -= sum(logp[j, d[i + 1]].item() for j, d in enumerate(docs))
    return math.exp(nll / (DOCS * TOKENS)), DOCS / statistics.median(steps)


def int4_smollm2():
    """(SmolLM2-135M quantised to int4, its tokenizer) on one thread; exits where fbgemm's
    VNNI products do not run (these benchmarks compare them)."""
    if not vnni_int8_available():
        raise SystemExit("this CPU has no AVX512-VNNI (or torch no fbgemm): nothing to compare")
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2")
    Q.quantize_model(model, "int4")
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds")
    args = parser.parse_args()
    model, tokenizer = int4_smollm2()
    assert isinstance(model.lm_head, Q.Int8Linear) and model.lm_head.vnni_min_rows == 1
    docs = documents(tokenizer)
    modes = ("off", "on", "on, 8-bit activations")
    runs: dict[str, list[dict]] = {"layer": [], **{mode: [] for mode in modes}}
    for r in range(args.rounds):
        runs["layer"].append(output_layer(model))
        for mode in modes if r % 2 == 0 else modes[::-1]:
            use_vnni(mode != "off")
            use_residual(model, mode == "on")
            runs[mode].append(decode_path(model, docs))
            print(f"round {r + 1} {mode}: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in runs[mode][-1].items()), flush=True)
    use_vnni(True)
    use_residual(model, True)
    summary = {name: {k: statistics.median(run[k] for run in rounds) for k in rounds[0]}
               for name, rounds in runs.items()}
    for name, figures in summary.items():
        print(name, json.dumps({k: round(v, 4) for k, v in figures.items()}))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": 1,
                                   "load": os.getloadavg(), "rounds": args.rounds,
                                   "medians": summary, "runs": runs},
                                  indent=1))


if __name__ == "__main__":
    main()
