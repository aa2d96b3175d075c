"""Where a hybrid GGUF's time goes in process: load, quantise, prefill, eager and compiled decode.

The Granite-4.0-H-350M-shaped Q8_0 file of ``vs_llamacpp_hybrid`` (random weights, made
there), one thread: ``load_model`` and ``--quantize auto`` seconds, a 1,024-token prefill,
and one sequence's decode step through the engine, eagerly and through ``torch.compile``
(one decode width, built first: its build time reported too). ``--quick``: no compiled
step.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import vs_llamacpp_hybrid as hybrid


def add_args(p) -> None:
    p.add_argument("--model", default="granite-4.0-h-350m", choices=list(hybrid.SHAPES))
    p.add_argument("--type", default="Q8_0", help="GGUF type")


def step_ms(model, compile_: bool) -> tuple[float, float]:
    """(ms a decoded token, seconds of the first request: the compile) for one sequence."""
    from hyla.serve.engine import Engine, EngineConfig
    from hyla.serve.sequence import SamplingParams

    eng = Engine(model, None, EngineConfig(max_num_seqs=1, max_model_len=2048,
                                           compile=compile_, decode_widths=(1,)))
    prompt = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0))
    greedy = dict(temperature=0, ignore_eos=True)
    t = time.perf_counter()
    eng.generate([prompt.tolist()], SamplingParams(max_tokens=4, **greedy))
    first = time.perf_counter() - t
    took = {}
    for n in (8, 72):
        t = time.perf_counter()
        eng.generate([prompt.tolist()], SamplingParams(max_tokens=n, **greedy))
        took[n] = time.perf_counter() - t
    return 1e3 * (took[72] - took[8]) / 64, first


def main(run) -> None:
    from hyla.cli.model_flags import apply_quantize
    from hyla.model import load_model

    torch.set_num_threads(run.args.threads or 1)
    path = hybrid.gguf(run.args.model, run.args.type)
    t = time.perf_counter()
    model, _ = load_model(path)
    row = {"model": run.args.model, "type": run.args.type,
           "load_s": time.perf_counter() - t}
    t = time.perf_counter()
    model = apply_quantize(model, argparse.Namespace(quantize="auto")).eval()
    row["quantize_s"] = time.perf_counter() - t
    ids = torch.randint(0, 1000, (1024,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.prefill(ids[:64], model.new_state())                       # warm up
        t = time.perf_counter()
        model.prefill(ids, model.new_state())
    row["prefill_1k_tok_s"] = 1024 / (time.perf_counter() - t)
    row["eager_ms_a_token"], _ = step_ms(model, False)
    if not run.args.quick:
        row["compiled_ms_a_token"], row["compile_s"] = step_ms(model, True)
    run.table("one thread, in process", [row])
    run.save([row], summary=f"{row['model']} {row['type']}: load {row['load_s']:.1f} s, "
             f"quantise {row['quantize_s']:.1f} s, prefill {row['prefill_1k_tok_s']:.0f} tok/s, "
             f"decode {row['eager_ms_a_token']:.0f} ms a token eager"
             + (f", {row['compiled_ms_a_token']:.0f} ms compiled" if "compile_s" in row else ""))
