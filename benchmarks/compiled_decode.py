"""What ``torch.compile`` of the decode step (``hyla serve --compile``) buys on a CPU.

The engine's runner decoding through the quantised SmolLM2-135M (int4) and a distilled
student, eager against compiled, side by side in one process, one thread, alternating
rounds, medians: ms a step at one sequence and at 16, after a prompt of real held-out text,
and how far the compiled step's logits are from the eager ones (teacher-forced, the same
tokens), plus the seconds each graph took to build.

    python benchmarks/compiled_decode.py [--student runs/defaults/window-gla/ckpt-000170]

Writes benchmarks/results/compiled_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch

from hyla.data.corpus import iter_documents
from hyla.model.load import load_model
from hyla.model.quantize import prepare_copies, quantize_model
from hyla.perf import machine_info
from hyla.serve.runner import Runner

RESULTS = pathlib.Path(__file__).parent / "results" / "compiled_decode.json"
STEPS = 24


def held_out_ids(tokenizer, n: int) -> list[int]:
    text = ""
    for doc in iter_documents(None, "validation"):
        text += doc
        ids = tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the held-out split has fewer than {n} tokens")


def decode_run(runner: Runner, ids: list[int], prompt: int, width: int) -> tuple[list, list]:
    """Prefill ``width`` copies of ``ids[:prompt]``, then teacher-force STEPS tokens:
    (ms of each step, the first sequence's logits of each step)."""
    blocks = (prompt + STEPS) // 16 + 2
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(width)]
    for j in range(width):
        runner.reset_slot(j)
        runner.prefill([(j, ids[:prompt], 0, tables[j])])
    times, logits = [], []
    for i in range(STEPS):
        start = time.perf_counter()
        out = runner.decode(list(range(width)), [ids[prompt + i]] * width,
                            [prompt + i] * width, tables, width=width)
        times.append(1e3 * (time.perf_counter() - start))
        logits.append(out[0])
    return times, logits


def compare(name: str, model, ids: list[int], prompt: int, width: int, rounds: int) -> dict:
    blocks = width * ((prompt + STEPS) // 16 + 2) + 1
    runners = {mode: Runner(model, max_num_seqs=width, num_kv_blocks=blocks,
                            kv_dtype=torch.bfloat16, compile=mode == "compiled")
               for mode in ("eager", "compiled")}
    began = time.perf_counter()
    runners["compiled"].warmup((width,), (prompt + STEPS) // 16 + 2)
    build_s = time.perf_counter() - began
    ms: dict[str, list[float]] = {"eager": [], "compiled": []}
    logits = {}
    for r in range(rounds):
        for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            times, logits[mode] = decode_run(runners[mode], ids, prompt, width)
            ms[mode].append(statistics.median(times[2:]))
    a, b = torch.stack(logits["eager"]), torch.stack(logits["compiled"])
    row = {"model": name, "width": width, "prompt_tokens": prompt, "graph_build_s": build_s,
           "eager_ms": statistics.median(ms["eager"]),
           "compiled_ms": statistics.median(ms["compiled"]), "rounds_ms": ms,
           "max_abs_logit_diff": (a - b).abs().max().item(),
           "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--student", default=None, help="a distilled student run directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    sources = [("SmolLM2-135M int4", "smollm2")]
    if args.student:
        sources.append((f"student {pathlib.Path(args.student).name} int4", args.student))
    for name, source in sources:
        model, tokenizer = load_model(source)
        quantize_model(model, "int4")
        prepare_copies(model)
        ids = held_out_ids(tokenizer, 1024 + STEPS)
        for width, prompt in ((1, 256), (16, 64)) if source == "smollm2" else ((1, 1024),):
            rows.append(compare(name, model, ids, prompt, width, args.rounds))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": 1,
                                   "load": os.getloadavg(), "rounds": args.rounds,
                                   "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
