"""Continuous batching serves >= 3x transformers' generate and >= 10x one request at a time.

64 requests, lengths from the Azure conversation trace / 4, greedy: the Engine (``small``) with
all concurrent, ``transformers`` generate on a same-shaped Llama (32 left-padded prompts a batch)
and ``hyla.model.generate`` one at a time, alternating ``--repeats``; then the engine at 1-64
concurrent. ``--quick``: 8 requests, one repeat.
"""

import statistics
import time

import torch

from benchmarks import serve_common as sc
from hyla.model.generate import generate

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def run_engine(model, prompts, outs, concurrency: int):
    eng = sc.engine(model, max_num_seqs=concurrency, max_model_len=4096,
                    max_num_batched_tokens=2048)
    t0, seqs = time.perf_counter(), eng.generate(prompts, [sc.greedy(o) for o in outs])
    assert [len(s.output_ids) for s in seqs] == outs
    return time.perf_counter() - t0, eng


def run_hf(hf, prompts, outs, batch: int = 32) -> None:
    for i in range(0, len(prompts), batch):
        ps, most = prompts[i:i + batch], max(outs[i:i + batch])    # only asked-for tokens count
        width = max(map(len, ps))
        ids, mask = torch.zeros(2, len(ps), width, dtype=torch.long)
        for b, p in enumerate(ps):                     # left padding, as generate wants
            ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=most,
                              min_new_tokens=most, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + most


def run_naive(model, prompts, outs) -> None:
    for p, o in zip(prompts, outs, strict=True):
        generate(model, p, o, temperature=0)


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    n = 8 if run.args.quick else 64
    work, model = sc.trace_workload(n, 4.0), sc.hyla_model("small")
    prompts = sc.random_prompts([p for p, _, _ in work], model.cfg.vocab_size)
    outs, hf = [o for _, o, _ in work], sc.llama_like(model.cfg)
    total_out, total_in = sum(outs), sum(map(len, prompts))
    times = run.rounds({
        f"hyla engine, {n} concurrent": lambda: run_engine(model, prompts, outs, n)[0],
        "transformers generate, batch 32": lambda: run_hf(hf, prompts, outs),
        "one request at a time (hyla.generate)": lambda: run_naive(model, prompts, outs)},
        1 if run.args.quick else run.args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"contender": k, "output_tok_s": total_out / t, "median_s": t,
             "engine_speedup": t / next(iter(med.values()))} for k, t in med.items()]
    run.table(f"{n} trace requests (lengths / 4), {total_out} output, {total_in} prompt tokens",
              rows)
    sweep = []
    for c in (c for c in WIDTHS if c <= n):
        run.progress(f"engine at {c} concurrent")
        dt, eng = run_engine(model, prompts, outs, c)
        sweep.append({"concurrency": c, "output_tok_s": total_out / dt, "seconds": dt,
                      "decode_share": eng.stats["decode_time_s"] / dt})
    run.table("hyla engine: output tokens/s by concurrency (one run each)", sweep)
    run.save(rows, sweep=sweep, repeats=len(times[rows[0]["contender"]]),
             workload={"requests": n, "length_scale": 4, "output_tokens": total_out,
                       "prompt_tokens": total_in, "trace": "azure_conv_2023.csv", "seed": 0},
             model={"hyla": "small preset (GGGA x2, d_model 384, 20.5M)", "transformers":
                    "LlamaForCausalLM, same width/depth/heads/vocab, all attention"},
             summary=f"engine ({n} concurrent) {rows[0]['output_tok_s']:.0f} output tok/s = "
                     f"{rows[1]['engine_speedup']:.1f}x transformers generate, "
                     f"{rows[2]['engine_speedup']:.1f}x one request at a time")
