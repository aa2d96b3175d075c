"""fbgemm's int8 products (hyla.model.vnni_int8) need 16-bit activations, or 8 bits rotated.

SmolLM2-135M int4, decoding 16 held-out documents x 128 tokens together, teacher-forced, eager,
one thread: perplexity and tokens/s with a row and its residual row (16 bits, the default), the
row alone (8 bits), and the row alone rotated (``VnniInt8Matmul.eight_bit``: ``int4-a8``).
"""

import statistics

from benchmarks.vnni_int8 import decode, int4_smollm2
from hyla.model.quantize import WeightOnlyLinear, prepare_copies
from hyla.model.vnni_int8 import VnniInt8Matmul


def main(run) -> None:
    model, docs = int4_smollm2(run)
    prepare_copies(model)
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    products = {"16-bit": {m: m.vnni_matmul() for m in layers},
                "8-bit": {m: VnniInt8Matmul(*m.int8_rows(), residual=False) for m in layers},
                "8-bit rotated": {m: VnniInt8Matmul.eight_bit(m.dequantized()) for m in layers}}

    def case(mode: str) -> tuple[float, float]:
        for m in layers:
            m.__dict__["_vnni"] = products[mode][m]
        return decode(model, docs)[:2]

    runs = run.rounds({mode: lambda mode=mode: case(mode) for mode in products})
    rows = [{"activations": mode, "perplexity": v[0][0],
             "tok_s": statistics.median(x[1] for x in v)} for mode, v in runs.items()]
    run.table("decode path, the documents together", rows)
    run.save(rows, runs=runs, documents=len(docs), tokens=len(docs[0]) - 2, summary=", ".join(
        f"{r['activations']}: perplexity {r['perplexity']:.3f}, {r['tok_s']:.1f} tok/s"
        for r in rows))
