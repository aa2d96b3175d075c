"""The model-level sections of the GPU check (:mod:`gpu_check`): a training step's tokens/s
and MFU, serving throughput on the trace workload against ``transformers`` ``generate``, and
decode tokens/s against context length, eager and with CUDA graphs.

Serving and decode run with bf16 weights and fp32 recurrent states on CUDA (fp32 on the
CPU dry run). CUDA graphs capture the eager decode step (``torch.compile`` would compile
one graph per decode shape: minutes, more than the check's budget); the dry run drives the
same runner with a stand-in capture.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve_common import llama_like, random_prompts, trace_workload  # noqa: E402

from hyla.model import HylaLM, preset  # noqa: E402
from hyla.model.context import Context  # noqa: E402
from hyla.perf import matmul_peak_flops, time_fn  # noqa: E402
from hyla.serve.engine import Engine, EngineConfig  # noqa: E402
from hyla.serve.runner import Runner  # noqa: E402
from hyla.serve.sequence import SamplingParams  # noqa: E402


def _dtype(dev) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _rerun_capture(fn, inputs, pool):
    """CPU stand-in for a CUDA graph: a replay re-runs the step on the static inputs."""
    out = fn(*inputs)
    return (lambda: out.copy_(fn(*inputs))), out


def _capture(dev):
    return None if dev.type == "cuda" else _rerun_capture


def _model(name: str, dev, layers: str | None = None) -> HylaLM:
    cfg = preset(name)
    if layers is not None:
        cfg = dataclasses.replace(cfg, layers=layers)
    torch.manual_seed(0)
    return HylaLM(cfg).to(dev, _dtype(dev)).eval()


def train_step(s, dev) -> list[dict]:
    """AdamW steps of ``train_batch x train_len`` tokens (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    cfg = preset(s.train_preset)
    model = HylaLM(cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (s.train_batch, s.train_len), device=dev)
    ctx = Context.train(ids)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(ids, ctx)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sec = time_fn(step, repeats=s.train_steps, warmup=2)
    tokens = s.train_batch * s.train_len
    params = sum(p.numel() for p in model.parameters())
    peak_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peak = matmul_peak_flops(peak_dtype, size=s.peak_size, repeats=3, device=dev)
    flops = 6 * params * tokens / sec           # the 6N rule: mixers' own FLOPs not counted
    return [{"section": "train", "preset": s.train_preset, "params": params,
             "tokens_per_step": tokens, "step_s": sec, "tokens_per_s": tokens / sec,
             "matmul_peak_tflops": peak / 1e12, "mfu_6N": flops / peak}]


def serving(s, dev) -> list[dict]:
    """The trace workload through hyla's engine (eager, CUDA graphs) and through
    ``transformers`` ``generate`` on a Llama of the same shape, output tokens/s."""
    work = trace_workload(s.serve_requests, s.serve_length_scale)
    lens, outs = [p for p, _, _ in work], [o for _, o, _ in work]
    model = _model(s.decode_preset, dev)
    prompts = random_prompts(lens, model.cfg.vocab_size)
    max_len = max(p + o for p, o in zip(lens, outs, strict=True))
    max_len = -(-max_len // 256) * 256
    rows = []
    for mode in ("eager", "cuda_graphs"):
        cfg = EngineConfig(max_num_seqs=s.serve_max_seqs, max_model_len=max_len,
                           max_num_batched_tokens=max(2048, max(lens)))
        eng = Engine(model, None, cfg)
        if mode == "cuda_graphs":
            from hyla.serve.cuda_graphs import DecodeGraphs

            eng.runner.graphs = DecodeGraphs(eng.runner._decode_fn, capture=_capture(dev))
        t0 = time.perf_counter()
        eng.warmup()
        warm = time.perf_counter() - t0
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
        _sync(dev)
        t0 = time.perf_counter()
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=o, temperature=0,
                                                     ignore_eos=True) for o in outs])
        _sync(dev)
        sec = time.perf_counter() - t0
        assert [len(q.output_ids) for q in seqs] == outs
        graphs = eng.runner.graphs
        rows.append({"section": "serve", "contender": f"hyla engine ({mode})",
                     "requests": len(prompts), "prompt_tokens": sum(lens),
                     "output_tokens": sum(outs), "seconds": sec,
                     "output_tok_per_s": sum(outs) / sec, "warmup_s": warm,
                     "captures": eng.runner.num_captures,
                     "capture_failures": graphs.capture_failures if graphs else 0})
    rows.append(_hf_generate(model.cfg, prompts, outs, dev))
    hf = rows[-1].get("output_tok_per_s")
    for r in rows[:-1]:
        if hf:
            r["vs_transformers"] = r["output_tok_per_s"] / hf
    return rows


def _hf_generate(cfg, prompts, outs, dev, batch: int = 32) -> dict:
    try:
        hf = llama_like(cfg).to(dev, _dtype(dev))
    except ImportError as e:
        return {"section": "serve", "contender": "transformers generate", "skipped": str(e)}
    _sync(dev)
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
            hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                        max_new_tokens=max(os_), min_new_tokens=max(os_), do_sample=False,
                        pad_token_id=0)
    _sync(dev)
    sec = time.perf_counter() - t0
    return {"section": "serve", "contender": f"transformers generate (batches of {batch})",
            "requests": len(prompts), "output_tokens": sum(outs), "seconds": sec,
            "output_tok_per_s": sum(outs) / sec}


def decode_vs_context(s, dev) -> list[dict]:
    """Decode step of ``decode_batch`` sequences at each context length, GLA-only and the
    preset's hybrid, eager and replayed from CUDA graphs (states and KV left as zeros:
    the cost does not depend on their values)."""
    rows = []
    B, bs = s.decode_batch, 16
    for layers in ("G" * len(preset(s.decode_preset).layers), None):
        model = _model(s.decode_preset, dev, layers)
        for ctx in s.decode_contexts:
            nblk = ctx // bs + 1
            row = {"section": "decode", "layers": model.cfg.layers, "batch": B,
                   "context": ctx}
            for mode in ("eager", "cuda_graphs"):
                r = Runner(model, max_num_seqs=B, num_kv_blocks=B * nblk, block_size=bs,
                           cuda_graphs=mode == "cuda_graphs", capture=_capture(dev))
                tables = [list(range(b * nblk, (b + 1) * nblk)) for b in range(B)]
                args = (list(range(B)), [1] * B, [ctx] * B, tables, B)
                sec = time_fn(lambda r=r, args=args: r.decode(*args), repeats=max(3, s.repeats),
                              warmup=2)
                row[f"{mode}_tok_per_s"] = B / sec
                del r
            row["graphs_speedup"] = row["cuda_graphs_tok_per_s"] / row["eager_tok_per_s"]
            rows.append(row)
        first = rows[-len(s.decode_contexts)]
        for r in rows[-len(s.decode_contexts):]:
            r["eager_vs_shortest"] = r["eager_tok_per_s"] / first["eager_tok_per_s"]
    return rows


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()
