"""What weight-only quantisation costs and buys on a real model: SmolLM2-135M-Instruct.

For each scheme (none = the GGUF dequantised to fp32, int8, int4) on one thread:
- perplexity on the stdlib corpus's held-out split (512-token windows);
- weight bytes in memory;
- single-sequence decode tokens/s (HylaLM.prefill/decode, greedy) and the prefill tokens/s
  of a 1,024-token prompt, the schemes timed in
  alternating rounds so that a load on the machine hits all of them alike; medians.

    python benchmarks/quantize.py [--tokens 16384] [--rounds 3]

Writes benchmarks/results/quantize.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import platform
import statistics
import time

import torch

from hyla.eval.perplexity import perplexity
from hyla.model.load import load_model
from hyla.model.names import resolve_name
from hyla.model.quantize import quantize_model

RESULTS = pathlib.Path(__file__).parent / "results" / "quantize.json"
SCHEMES = ("none", "int8", "int4")


@torch.no_grad()
def prefill_tokens_per_s(model, prompt: torch.Tensor) -> float:
    start = time.perf_counter()
    model.prefill(prompt, model.new_state())
    return len(prompt) / (time.perf_counter() - start)


@torch.no_grad()
def decode_tokens_per_s(model, prompt: torch.Tensor, steps: int) -> float:
    state = model.new_state()
    logits = model.prefill(prompt, state)
    token = logits[-1].argmax().view(1)
    start = time.perf_counter()
    for _ in range(steps):
        token = model.decode(token, [state])[0].argmax().view(1)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored")
    parser.add_argument("--rounds", type=int, default=3, help="decode timing rounds")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base, tok = load_model(resolve_name("smollm2"))   # ValueError says how to install it
    models, rows = {}, {}
    for scheme in SCHEMES:
        model = copy.deepcopy(base) if scheme != "none" else base
        report = quantize_model(model, scheme)
        models[scheme] = model
        ppl = perplexity(model, tok, seq_len=512, max_tokens=args.tokens, batch_size=4)
        rows[scheme] = {"weight_bytes": report.bytes_after, "int4_layers": report.int4_layers,
                        "perplexity": ppl["perplexity"], "tokens_scored": ppl["tokens"],
                        "decode_tok_s": [], "prefill_tok_s": []}
        print(f"{scheme}: ppl {ppl['perplexity']:.3f} on {ppl['tokens']} tokens, "
              f"{report.bytes_after / 1e6:.0f} MB of weights", flush=True)
    prompt = torch.tensor(tok.encode("def fibonacci(n):\n    \"\"\"Return the"), dtype=torch.long)
    long_prompt = torch.tensor(tok.encode(open(copy.__file__).read()), dtype=torch.long)[:1024]
    for _ in range(args.rounds):
        for scheme in SCHEMES:
            rows[scheme]["decode_tok_s"].append(decode_tokens_per_s(models[scheme], prompt,
                                                                    args.steps))
            rows[scheme]["prefill_tok_s"].append(prefill_tokens_per_s(models[scheme],
                                                                      long_prompt))
    ref = rows["none"]
    print(f"\n{'scheme':8} {'weights':>9} {'ppl':>8} {'vs fp32':>8} {'decode tok/s':>13} "
          f"{'vs fp32':>8} {'prefill tok/s':>14} {'vs fp32':>8}")
    for scheme, r in rows.items():
        r["decode_tok_s_median"] = statistics.median(r["decode_tok_s"])
        r["ppl_ratio"] = r["perplexity"] / ref["perplexity"]
        r["decode_ratio"] = r["decode_tok_s_median"] / statistics.median(ref["decode_tok_s"])
        r["prefill_tok_s_median"] = statistics.median(r["prefill_tok_s"])
        r["prefill_ratio"] = r["prefill_tok_s_median"] / statistics.median(ref["prefill_tok_s"])
        print(f"{scheme:8} {r['weight_bytes'] / 1e6:7.0f}MB {r['perplexity']:8.3f} "
              f"{r['ppl_ratio']:7.3f}x {r['decode_tok_s_median']:13.1f} {r['decode_ratio']:7.2f}x "
              f"{r['prefill_tok_s_median']:14.1f} {r['prefill_ratio']:7.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "threads": 1, "rounds": args.rounds,
        "decode_steps": args.steps, "machine": f"{platform.machine()} {platform.processor()}",
        "cpu_fast_bf16": torch.cpu._is_avx512_bf16_supported() or
        torch.cpu._is_amx_tile_supported(), "schemes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
