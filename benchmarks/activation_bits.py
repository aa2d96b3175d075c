"""How many bits fbgemm's int8 products need on the activations (hyla.model.vnni_int8).

The products quantise each activation row to 8 bits and add a residual row (16 bits in all),
which doubles their work: about 60% of a 16-wide SmolLM2 decode step. Measured here on
SmolLM2-135M int4, 16 held-out documents x 128 tokens decoded together (eager, one thread),
teacher-forced: decode-path perplexity and tokens/s for

- ``16-bit``: a row and its residual (hyla's default);
- ``8-bit``: the row alone (``VnniInt8Matmul(residual=False)``);
- ``8-bit rotated``: the row alone after an orthogonal rotation that spreads outlier
  channels (random signs, then Hadamard blocks of 64, QuaRot-style); the weight is rotated
  alike before its int8 quantisation, so the product is unchanged but for rounding
  (``VnniInt8Matmul.eight_bit``: what ``--quantize int4-a8`` runs).

    python benchmarks/activation_bits.py [--rounds 1]

Writes benchmarks/results/activation_bits.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

from hyla.model import quantize as Q
from hyla.model.quantize import prepare_copies
from hyla.model.vnni_int8 import VnniInt8Matmul
from hyla.perf import machine_info

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from vnni_int8 import DOCS, TOKENS, decode_together, documents, int4_smollm2  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "activation_bits.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds")
    args = parser.parse_args()
    model, tokenizer = int4_smollm2()
    prepare_copies(model)
    docs = documents(tokenizer)
    layers = [m for m in model.modules() if isinstance(m, Q.WeightOnlyLinear)]
    products = {"16-bit": {}, "8-bit": {}, "8-bit rotated": {}}
    for m in layers:
        w = m.dequantized()
        products["16-bit"][m] = m.vnni_matmul()
        products["8-bit"][m] = VnniInt8Matmul(*m.int8_rows(), residual=False)
        products["8-bit rotated"][m] = VnniInt8Matmul.eight_bit(w)
    runs: dict[str, list] = {mode: [] for mode in products}
    for r in range(args.rounds):
        for mode in list(products) if r % 2 == 0 else list(products)[::-1]:
            for m in layers:
                m.__dict__["_vnni"] = products[mode][m]
            runs[mode].append(decode_together(model, docs))
            print(f"round {r + 1} {mode}: perplexity {runs[mode][-1][0]:.4f}, "
                  f"{runs[mode][-1][1]:.1f} tok/s", flush=True)
    summary = {mode: {"perplexity": v[0][0], "tok_s": statistics.median(x[1] for x in v)}
               for mode, v in runs.items()}
    print(json.dumps(summary))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": 1,
                                   "load": os.getloadavg(), "rounds": args.rounds,
                                   "documents": DOCS, "tokens": TOKENS, "median": summary,
                                   "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
