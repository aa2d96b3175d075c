"""Claim: the serving engine's single-request decode is faster with its KV cache read in
place (no per-step gather) and held in bfloat16 where bf16 is fast, for each weight scheme.

One request at a time through :class:`hyla.serve.engine.Engine` (what ``hyla serve``,
``generate`` and ``chat`` run), on SmolLM2-135M-Instruct Q4_1 by default, for each
``--quantize`` scheme and each prompt length. Two engines per scheme, side by side in
alternating rounds:

- ``before``: KV blocks in the model's dtype (fp32), every decode step gathers each
  sequence's blocks into a new tensor (``Runner(kv_in_place=False)``, the old path);
- ``after``: KV blocks in ``--kv-cache-dtype`` (auto: the model's; bfloat16 halves them),
  decode reads the blocks in place.

Decode tok/s counts the tokens after the first (the first is the prompt's), median of the
rounds. The prompt is the same each round, so from the second round on the prefix cache
serves it and rounds cost little beyond their decode. ``--profile`` adds a torch.profiler
table of one ``after`` decode run per scheme (self CPU time by op).

    python benchmarks/engine_decode.py --threads 1            # SmolLM2, 128 and 1024 tokens
    python benchmarks/engine_decode.py --preset debug --quick  # seconds

Writes ``benchmarks/results/engine_decode.json`` (``engine_decode_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from hyla.model.quantize import quantize_model
from hyla.perf import print_table, tune_cpu_allocator, write_results
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams


def load(args):
    if args.preset:
        from hyla.model import HylaLM, preset

        torch.manual_seed(0)
        return HylaLM(preset(args.preset)).eval(), f"hyla-{args.preset} (random)"
    from hyla.model.load import load_model, model_name

    model, _ = load_model(args.checkpoint)
    return model, model_name(args.checkpoint)


def engine(model, variant: str, max_len: int, kv_dtype: str = "auto") -> Engine:
    after = variant == "after"
    eng = Engine(model, None, EngineConfig(max_num_seqs=1, max_model_len=max_len,
                                           kv_cache_dtype=kv_dtype if after else None))
    eng.runner.kv_in_place = after
    return eng


def decode_rate(eng: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Decode tok/s of one greedy request (the tokens after its first): by wall time, and by
    this thread's CPU time (with one torch thread, the work itself: steadier on a machine
    other processes load)."""
    eng.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                           ignore_eos=True))
    first = cpu = None
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.token_ids)
            if first is None and o.token_ids:
                first, cpu, n = time.perf_counter(), time.thread_time(), 0
    return n / (time.perf_counter() - first), n / (time.thread_time() - cpu)


def generate_rate(model, state, prompt: list[int], tokens: int) -> tuple[float, float]:
    """As :func:`decode_rate` for ``hyla generate``'s loop (:func:`stream_tokens`) on
    ``state``: a SequenceState (HylaLM.prefill/decode, the old path) or a RunnerState."""
    from hyla.model.stream import stream_tokens

    first = cpu = None
    n = 0
    for _ in stream_tokens(model, state, prompt, tokens + 1, temperature=0):
        if first is None:
            first, cpu = time.perf_counter(), time.thread_time()
        else:
            n += 1
    return n / (time.perf_counter() - first), n / (time.thread_time() - cpu)


def profile(eng: Engine, prompt: list[int], tokens: int, top: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decode_rate(eng, prompt, 4)     # the prompt in the prefix cache: mostly decode below
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_rate(eng, prompt, tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key[:48], "calls": e.count,
             "self_ms_per_token": e.self_cpu_time_total / 1e3 / tokens,
             "share": e.self_cpu_time_total / total} for e in events[:top]]


def main(argv=None) -> None:
    tune_cpu_allocator()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="smollm2", help="any load_model source "
                   "(default: %(default)s)")
    p.add_argument("--preset", default=None, help="random weights of a preset instead")
    p.add_argument("--schemes", default="none,int8,int4",
                   help="comma-separated --quantize schemes (default: %(default)s)")
    p.add_argument("--prompts", default="128,1024",
                   help="comma-separated prompt lengths (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded a request "
                   "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds "
                   "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--profile", action="store_true", help="profile one decode per scheme")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the after engine's KV dtype (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="64-token prompt, 2 rounds")
    p.add_argument("--generate", action="store_true",
                   help="also hyla generate's loop: HylaLM.prefill/decode (before) against "
                        "the runner (RunnerState, after)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.prompts, args.rounds, args.tokens = "64", 2, 16
    base, name = load(args)
    prompts = [int(x) for x in args.prompts.split(",")]
    vocab = base.cfg.vocab_size
    rows, profiles = [], {}
    for scheme in args.schemes.split(","):
        model = copy.deepcopy(base)
        quantize_model(model, scheme)
        for n in prompts:
            prompt = [(17 + 31 * i) % vocab for i in range(n)]
            max_len = n + args.tokens + 16
            engines = {v: engine(model, v, max_len, args.kv_cache_dtype)
                       for v in ("before", "after")}
            for eng in engines.values():                  # warm-up, and prompt cached
                decode_rate(eng, prompt, 4)
            rates: dict = {v: [] for v in engines}
            for _ in range(args.rounds):
                for v, eng in engines.items():
                    rates[v].append(decode_rate(eng, prompt, args.tokens))
            wall = {v: statistics.median(r[0] for r in rs) for v, rs in rates.items()}
            cpu = {v: statistics.median(r[1] for r in rs) for v, rs in rates.items()}
            kv = str(engines["after"].runner.kv_dtype).removeprefix("torch.")
            rows.append({"quantize": scheme, "prompt": n, "path": "engine",
                         "before_tok_s": round(wall["before"], 2),
                         "after_tok_s": round(wall["after"], 2),
                         "before_cpu_tok_s": round(cpu["before"], 2),
                         "after_cpu_tok_s": round(cpu["after"], 2),
                         "speedup_cpu": round(cpu["after"] / cpu["before"], 3),
                         "after_kv_dtype": kv})
            print(rows[-1], flush=True)
            if args.profile and n == prompts[0]:
                profiles[scheme] = profile(engines["after"], prompt, args.tokens)
                print_table(f"after, --quantize {scheme}, prompt {n}: self CPU by op",
                            profiles[scheme])
            del engines
            if args.generate:
                from hyla.serve.session import RunnerState

                fresh = {"before": model.new_state, "after": lambda m=model: RunnerState(m)}
                got: dict = {v: [] for v in fresh}
                for _ in range(args.rounds):
                    for v, make in fresh.items():
                        got[v].append(generate_rate(model, make(), prompt, args.tokens))
                wall = {v: statistics.median(r[0] for r in rs) for v, rs in got.items()}
                cpu = {v: statistics.median(r[1] for r in rs) for v, rs in got.items()}
                rows.append({"quantize": scheme, "prompt": n, "path": "generate",
                             "before_tok_s": round(wall["before"], 2),
                             "after_tok_s": round(wall["after"], 2),
                             "before_cpu_tok_s": round(cpu["before"], 2),
                             "after_cpu_tok_s": round(cpu["after"], 2),
                             "speedup_cpu": round(cpu["after"] / cpu["before"], 3),
                             "after_kv_dtype": "model's"})
                print(rows[-1], flush=True)
        del model
    print_table(f"{name}: single-request decode tok/s, {args.threads} thread(s), "
                f"before (fp32 KV, gathered) vs after (in place, {args.kv_cache_dtype} KV)",
                rows)
    path = write_results("engine_decode_quick" if args.quick else "engine_decode", rows,
                         params={"model": name, "threads": args.threads,
                                 "kv_cache_dtype": args.kv_cache_dtype,
                                 "load_avg": os.getloadavg(),
                                 "tokens": args.tokens, "rounds": args.rounds},
                         profiles=profiles)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
