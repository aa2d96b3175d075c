"""Claim: continuous batching serves >= 3x the output tokens/s of transformers' generate
and >= 10x a one-request-at-a-time loop, on trace-shaped requests.

Workload: 64 requests whose prompt and output lengths are drawn (seed 0) from the Azure
conversation trace (``azure-conv``, shipped with hyla), lengths divided by
``--length-scale`` (default 4) to fit this CPU; prompts are random token ids, outputs run
to their trace length (greedy, EOS ignored). Contenders, one after another in one process,
each repeated and the median taken:

- hyla's Engine at 1 .. 64 concurrent sequences (``max_num_seqs``), the ``small`` preset;
- Hugging Face ``transformers`` ``generate`` on a Llama of the same width, depth, heads and
  vocabulary, run the way a user would: 32 prompts at a time, left-padded, each batch
  generating until its longest request is done (only the tokens each request asked for
  count as output);
- ``hyla.model.generate`` one request at a time (prefill, then a decode loop).

Also writes ``benchmarks/results/serve_profile.json``: measured prefill tokens/s and decode
step times per batch width, the CPU hardware profile the PrfaaS simulator can load.

    python benchmarks/serve_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve_common import hyla_model, llama_like, random_prompts, trace_workload  # noqa: E402

from hyla.model.generate import generate  # noqa: E402
from hyla.perf import RESULTS_DIR, print_table, tune_cpu_allocator, write_results  # noqa: E402
from hyla.serve.engine import Engine, EngineConfig  # noqa: E402
from hyla.serve.sequence import SamplingParams  # noqa: E402


def run_engine(model, prompts, outs, concurrency: int) -> tuple[float, Engine]:
    eng = Engine(model, None, EngineConfig(max_num_seqs=concurrency, max_model_len=4096,
                                           max_num_batched_tokens=2048))
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert [len(s.output_ids) for s in seqs] == outs
    return dt, eng


def run_hf(hf, prompts, outs, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outs[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for b, p in enumerate(ps):                     # left padding, as generate wants
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_),
                              min_new_tokens=max(os_), do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + max(os_)
    return time.perf_counter() - t0


def run_naive(model, prompts, outs) -> float:
    t0 = time.perf_counter()
    for p, o in zip(prompts, outs, strict=True):
        generate(model, p, o, temperature=0)
    return time.perf_counter() - t0


def decode_profile(model, widths, context: int = 256, steps: int = 8) -> dict:
    """Decode step seconds per batch width, and prefill tokens/s, from the runner."""
    from hyla.serve.runner import Runner

    base = max(widths) * 32
    r = Runner(model, max_num_seqs=max(widths), num_kv_blocks=base + 64, block_size=16)
    tables = [list(range(b * 32, b * 32 + context // 16 + 1)) for b in range(max(widths))]
    out = {}
    for w in widths:
        args = (list(range(w)), [1] * w, [context] * w, tables[:w], w)
        r.decode(*args)
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            r.decode(*args)
            ts.append(time.perf_counter() - t0)
        out[str(w)] = statistics.median(ts)
    prompt = [i % (model.cfg.vocab_size - 1) + 1 for i in range(1024)]   # ids in vocab
    chunk = [(0, prompt, 0, list(range(base, base + 64)))]
    r.prefill(chunk)
    t0 = time.perf_counter()
    r.prefill(chunk)
    return {"decode_step_s": out, "prefill_tok_s": len(prompt) / (time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on this 2-vCPU VM a second intra-op thread "
                         "makes the small ops of a decode step 2-5x slower)")
    ap.add_argument("--quick", action="store_true", help="8 requests, 1 repeat")
    ap.add_argument("--length-scale", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    n = 8 if args.quick else 64
    repeats = 1 if args.quick else args.repeats
    work = trace_workload(n, args.length_scale)
    model = hyla_model("small")
    cfg = model.cfg
    prompts = random_prompts([p for p, _, _ in work], cfg.vocab_size)
    outs = [o for _, o, _ in work]
    total_out = sum(outs)
    hf = llama_like(cfg)
    conc = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= n]

    rows, times = [], {}
    for rep in range(repeats):            # interleaved, so drift hits every contender
        times.setdefault(f"hyla engine, {n} concurrent", []).append(
            run_engine(model, prompts, outs, n)[0])
        times.setdefault("transformers generate, batch 32", []).append(
            run_hf(hf, prompts, outs, min(32, n)))
        times.setdefault("one request at a time (hyla.generate)", []).append(
            run_naive(model, prompts, outs))
        print(f"repeat {rep + 1}/{repeats}: " + ", ".join(f"{k}: {v[-1]:.1f}s"
                                                        for k, v in times.items()), flush=True)
    base = {k: total_out / statistics.median(v) for k, v in times.items()}
    eng_tps = base[f"hyla engine, {n} concurrent"]
    for k, tps in base.items():
        rows.append({"contender": k, "output_tok_s": tps,
                     "median_s": statistics.median(times[k]),
                     "engine_speedup": eng_tps / tps})
    print_table(f"{n} trace requests (lengths / {args.length_scale:g}), {total_out} output "
                f"tokens, {sum(len(p) for p in prompts)} prompt tokens", rows)

    sweep = []
    for c in conc:
        dt, eng = run_engine(model, prompts, outs, c)
        sweep.append({"concurrency": c, "output_tok_s": total_out / dt, "seconds": dt,
                      "decode_share": eng.stats["decode_time_s"] / dt})
    print_table("hyla engine: output tokens/s by concurrency (one run each)", sweep)

    prof = decode_profile(model, [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= max(conc)])
    profile = {"name": "cpu-2core", "preset": "small", "step_overhead_s": 0.0,
               "mem_gb": 24, **prof}
    if not args.quick:
        (RESULTS_DIR / "serve_profile.json").write_text(json.dumps(profile, indent=2) + "\n")
    print("profile:", json.dumps(profile))
    path = write_results("serve_throughput_quick" if args.quick else "serve_throughput",
                         rows, sweep=sweep, profile=profile,
                         workload={"requests": n, "length_scale": args.length_scale,
                                   "output_tokens": total_out,
                                   "prompt_tokens": sum(len(p) for p in prompts),
                                   "trace": "azure_conv_2023.csv", "seed": 0},
                         model={"hyla": "small preset (GGGA x2, d_model 384, 20.5M)",
                                "transformers": "LlamaForCausalLM, same width/depth/heads/"
                                                "vocab, all attention"},
                         repeats=repeats)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
