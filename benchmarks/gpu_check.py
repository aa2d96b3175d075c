"""On a GPU every op matches its fp32 CPU reference; kernel, training and serving speeds too.

Run by ``bash benchmarks/gpu_check.sh`` (one H200, under 8 minutes). Sections, each recorded
even when another fails: ``ops`` (outputs, states, gradients vs the fp32 CPU reference within
5e-3 bf16 / 1e-5 fp32), ``gla_speed`` (chunk_gla native vs fla vs SDPA, T 4K-32K),
``streamkl_speed`` (triton vs chunk vs materialised), ``train`` (tokens/s, MFU), ``serve``
(engine eager and CUDA graphs vs transformers ``generate``), ``decode`` (tokens/s by context).
``--dry-run``: tiny shapes on the CPU, CUDA-only kernels skipped, a stand-in graph capture.
"""

from __future__ import annotations

import time
import traceback
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.serve_common import hyla_model, llama_like, random_prompts, trace_workload
from hyla.model import HylaLM, preset
from hyla.model.context import Context
from hyla.ops.attention import attention
from hyla.ops.backends import select
from hyla.ops.deltanet import chunk_gated_delta, naive_recurrent_gated_delta, recurrent_gated_delta
from hyla.ops.gla import chunk_gla, naive_recurrent_gla, recurrent_gla
from hyla.ops.newton_schulz import newton_schulz
from hyla.ops.streamkl import attention_kl, naive_attention_kl
from hyla.perf import matmul_peak_flops, time_fn
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams

FULL = dict(ops_T=300, ops_H=4, ops_D=64, gla_T=(4096, 8192, 16384, 32768), gla_H=16,
            gla_D=128, kl_N=(4096, 8192, 16384, 32768), kl_H=8, kl_D=64, kl_naive_max=16384,
            repeats=3, train_preset="small", train_batch=8, train_len=2048, train_steps=5,
            serve_requests=64, serve_length_scale=1.0, serve_max_seqs=64,
            decode_preset="small", decode_batch=4, decode_contexts=(1024, 4096, 16384, 32768),
            peak_size=8192)
DRY = dict(ops_T=37, ops_H=2, ops_D=16, gla_T=(64, 128), gla_H=2, gla_D=16, kl_N=(64, 128),
           kl_H=2, kl_D=16, kl_naive_max=128, repeats=1, train_preset="debug", train_batch=2,
           train_len=64, train_steps=1, serve_requests=3, serve_length_scale=64.0,
           serve_max_seqs=2, decode_preset="debug", decode_batch=2, decode_contexts=(16, 48),
           peak_size=128)
BOUND = {torch.bfloat16: 5e-3, torch.float32: 1e-5}


def add_args(parser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--sections", default="ops,gla_speed,streamkl_speed,train,serve,decode")


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double().cpu(), x.detach().double().cpu()
    den = ref.norm().item()
    return (ref - x).norm().item() / den if den > 0 else x.norm().item()


def outs_grads(fn, leaves, cot):
    """``fn``'s outputs and, given cotangents ``cot``, its inputs' gradients."""
    if cot is None:
        with torch.no_grad():
            return [o for o in fn(*leaves) if o is not None], []
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    outs = fn(*leaves)
    pairs = [(o, c) for o, c in zip(outs if isinstance(outs, tuple) else (outs,), cot,
                                    strict=True) if o is not None]
    torch.autograd.backward([o for o, _ in pairs], [c.to(o.device, o.dtype) for o, c in pairs])
    return [o.detach() for o, _ in pairs], [x.grad for x in leaves]


def check(label, op, ref_fn, fn, xs, cast, cot, dtype, gate, dev, backends) -> list[dict]:
    """``fn`` on the device in ``dtype`` (the inputs at ``cast``) per backend against
    ``ref_fn`` on the CPU in fp32 on the same inputs rounded to ``dtype``: the reference
    measures the op's error, not its inputs' rounding."""
    ref = outs_grads(ref_fn, [x.to(dtype).float() if i in cast else x
                              for i, x in enumerate(xs)], cot)
    leaves = [x.to(dev, dtype) if i in cast else x.to(dev) for i, x in enumerate(xs)]
    rows = []
    for backend in backends:
        head = {"section": "ops", "op": label, "dtype": str(dtype)[6:], "gates": gate}
        try:    # op None: ``backend`` is only the label
            name = select(op, tuple(leaves), {}, None if backend == "auto" else backend) \
                if op else backend
            got = outs_grads((lambda *a, b=backend: fn(*a, backend=b)) if op else fn, leaves,
                             cot)
        except ValueError as e:     # a forced backend that cannot run here
            rows.append(head | {"backend": backend, "skipped": str(e)})
            continue
        errs = {f"{kind}{i}": rel_rms(a, b) for kind, r, g in zip("od", ref, got, strict=True)
                for i, (a, b) in enumerate(zip(r, g, strict=True)) if None not in (a, b)}
        worst = max(errs.values())
        rows.append(head | {"backend": name, "max_rel_rms": worst, "bound": BOUND[dtype],
                            "ok": worst < BOUND[dtype], "errors": errs})
    return rows


def with_state(fn, **kw):
    return lambda *a, **k: fn(*a[:-1], initial_state=a[-1], output_final_state=True, **kw, **k)


def check_ops(s, dev) -> list[dict]:
    torch.manual_seed(0)    # seeded: the errors (bf16 ones within 10-20% of their bound) repeat
    B, T, H, D, rows = 2, s.ops_T, s.ops_H, s.ops_D, []
    chunked = ("auto", "native") if dev.type == "cuda" else ("native",)   # auto: native on CPU
    for dtype in (torch.bfloat16, torch.float32):
        for gate in ("harsh", "mild"):     # the decode forms below take the mild inputs
            q, k, v, x = torch.randn(4, B, T, H, D)
            g, h0 = F.logsigmoid(x) / (16 if gate == "mild" else 1), torch.randn(B, H, D, D)
            qn, kn, beta = F.normalize(q, dim=-1), F.normalize(k, dim=-1), torch.rand(B, T, H)
            cot = (torch.randn_like(v), torch.randn_like(h0))
            rows += check("chunk_gla", "chunk_gla", with_state(naive_recurrent_gla),
                          with_state(chunk_gla), (q, k, v, g, h0), {0, 1, 2}, cot, dtype, gate,
                          dev, chunked)
            for kind, gd in (("gdn", g.mean(-1)), ("kda", g)):
                rows += check(f"chunk_gated_delta({kind})", "chunk_gated_delta",
                              with_state(naive_recurrent_gated_delta),
                              with_state(chunk_gated_delta), (qn, kn, v, gd, beta, h0),
                              {0, 1, 2, 4}, cot, dtype, gate, dev, chunked)
        # the decode forms: 4 tokens from a random state, no gradient, auto backend
        four = [t[:, :4] for t in (q, k, v, g, qn, kn, beta)]
        rows += check("recurrent_gla", "recurrent_gla", with_state(naive_recurrent_gla),
                      with_state(recurrent_gla), (*four[:4], h0), {0, 1, 2}, None, dtype,
                      "mild", dev, ("auto",))
        rows += check("recurrent_gated_delta(gdn)", "recurrent_gated_delta",
                      with_state(naive_recurrent_gated_delta), with_state(recurrent_gated_delta),
                      (*four[4:6], four[2], four[3].mean(-1), four[6], h0), {0, 1, 2, 4}, None,
                      dtype, "mild", dev, ("auto",))
        kv = torch.randn(2, B, T, max(1, H // 2), D)
        rows += check("attention", None, attention, attention, (q, *kv), {0, 1, 2},
                      (torch.randn(B, T, H, D),), dtype, "-", dev, ("sdpa",))
        qs, ks = torch.randn(B, T, H, D // 2), torch.randn(B, T, 1, D // 2)
        rows += check("attention_kl", None, partial(naive_attention_kl, reduction="none"),
                      partial(attention_kl, reduction="none"), (q, kv[0], qs, ks),
                      {0, 1, 2, 3}, (torch.randn(B, H, T),), dtype, "-", dev,
                      ("triton" if dev.type == "cuda" else "chunk",))
        m = torch.randn(3, 4 * D, 2 * D)
        row, = check("newton_schulz", None, lambda m: (newton_schulz(m, dtype=torch.float32),),
                     lambda m, dt=dtype: (newton_schulz(m, dtype=dt),), (m,), set(), None,
                     dtype, "-", dev, ("native",))
        row["ok"] |= dtype == torch.bfloat16   # bf16 drifts from fp32 by design: report only
        rows.append(row)
    return rows


def time_pair(name, fn, inputs, do, repeats) -> dict:
    """Forward and forward + backward milliseconds of ``fn``, or why it did not run."""
    out = {}
    try:
        with torch.no_grad():
            out[f"{name}_fwd_ms"] = time_fn(lambda: fn(*inputs), repeats=repeats) * 1e3
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out[f"{name}_fwd_bwd_ms"] = time_fn(lambda: fn(*leaves).backward(do),
                                            repeats=repeats) * 1e3
    except ValueError as e:
        out[f"{name}_fwd_ms"] = f"skipped: {str(e)[:80]}"
    except torch.cuda.OutOfMemoryError:
        out |= {f"{name}_fwd_ms": out.get(f"{name}_fwd_ms", "oom"), f"{name}_fwd_bwd_ms": "oom"}
        torch.cuda.empty_cache()
    return out


def speed(section, s, dev, sizes, fns, make, skip, fast) -> list[dict]:
    """Each of ``fns`` timed at each size (inputs from ``make``), and ``fast`` against the
    others."""
    rows, dtype = [], torch.bfloat16 if dev.type == "cuda" else torch.float32
    for n in sizes:
        inputs, do, row = make(n, dtype, torch.Generator(device=dev).manual_seed(n))
        row = {"section": section, **row, "dtype": str(dtype)[6:]}
        for name, fn in fns.items():
            if why := skip(name, n):
                row[f"{name}_fwd_ms"] = f"skipped: {why}"
            else:
                row |= time_pair(name, fn, inputs, do, s.repeats)
        for mode in ("fwd", "fwd_bwd"):
            for other in fns:
                a, b = row.get(f"{other}_{mode}_ms"), row.get(f"{fast}_{mode}_ms")
                if other != fast and isinstance(a, float) and isinstance(b, float):
                    row[f"{fast}_vs_{other}_{mode}"] = a / b
        rows.append(row)
    return rows


def gla_speed(s, dev) -> list[dict]:
    def make(T, dtype, gen):
        q, k, v, x = torch.randn(4, 1, T, s.gla_H, s.gla_D, device=dev, generator=gen)
        return ((q.to(dtype), k.to(dtype), v.to(dtype), F.logsigmoid(x) / 16),
                torch.randn_like(v.to(dtype)), {"T": T, "H": s.gla_H, "K=V": s.gla_D})
    fns = {b: lambda *a, b=b: chunk_gla(*a, backend=b)[0] for b in ("native", "fla")}
    fns["sdpa"] = lambda q, k, v, g: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    return speed("gla_speed", s, dev, s.gla_T, fns, make, lambda *a: None, "fla")


def streamkl_speed(s, dev) -> list[dict]:
    def make(N, dtype, gen):
        return (tuple(torch.randn(4, 1, N, s.kl_H, s.kl_D, device=dev, generator=gen).to(dtype)),
                torch.ones((), device=dev), {"N": N, "H": s.kl_H, "D": s.kl_D})

    def skip(name, N):
        if name == "naive" and N > s.kl_naive_max:
            return "the N x N matrices do not fit"
        return "needs CUDA" if name == "triton" and dev.type != "cuda" else None
    return speed("streamkl_speed", s, dev, s.kl_N, {b: lambda *a, b=b: attention_kl(
        *a, backend=b) for b in ("triton", "chunk", "naive")}, make, skip, "triton")


def train_step(s, dev) -> list[dict]:
    """AdamW steps of ``train_batch x train_len`` tokens (bf16 autocast on CUDA)."""
    torch.manual_seed(0)
    model, cuda = HylaLM(cfg := preset(s.train_preset)).to(dev).train(), dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    ids = torch.randint(0, cfg.vocab_size, (s.train_batch, s.train_len), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(ids, Context.train(ids))
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sec, tokens = time_fn(step, repeats=s.train_steps, warmup=2), s.train_batch * s.train_len
    params = sum(p.numel() for p in model.parameters())
    peak = matmul_peak_flops(torch.bfloat16 if cuda else torch.float32, size=s.peak_size,
                             repeats=3, device=dev)
    return [{"section": "train", "preset": s.train_preset, "params": params,
             "tokens_per_step": tokens, "step_s": sec, "tokens_per_s": tokens / sec,
             "matmul_peak_tflops": peak / 1e12,   # the 6N rule: the mixers' own FLOPs left out
             "mfu_6N": 6 * params * tokens / sec / peak}]


def capture(dev):
    """CPU stand-in for a CUDA graph capture: a replay re-runs the step on static inputs."""
    def rerun(fn, inputs, pool):
        out = fn(*inputs)
        return (lambda: out.copy_(fn(*inputs))), out
    return None if dev.type == "cuda" else rerun


def model_on(name, dev, layers=None) -> HylaLM:   # bf16 weights on CUDA; states stay fp32
    return hyla_model(name, layers).to(dev, torch.bfloat16 if dev.type == "cuda" else None)


def serving(s, dev) -> list[dict]:
    """The trace workload through the engine (eager, CUDA graphs) and through transformers'
    ``generate`` on a Llama of the same shape (left-padded batches of 32): output tokens/s."""
    work = trace_workload(s.serve_requests, s.serve_length_scale)
    lens, outs = [p for p, _, _ in work], [o for _, o, _ in work]
    model = model_on(s.decode_preset, dev)
    prompts, rows = random_prompts(lens, model.cfg.vocab_size), []
    for mode in ("eager", "cuda_graphs"):
        eng = Engine(model, None, EngineConfig(
            max_num_seqs=s.serve_max_seqs, max_num_batched_tokens=max(2048, max(lens)),
            max_model_len=-(-max(p + o for p, o in zip(lens, outs, strict=True)) // 256) * 256))
        if mode == "cuda_graphs":
            from hyla.serve.cuda_graphs import DecodeGraphs

            eng.runner.graphs = DecodeGraphs(eng.runner._decode_fn, capture=capture(dev))
        warm, seqs = time_fn(eng.warmup, repeats=1, warmup=0), []
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
        sec = time_fn(lambda e=eng, q=seqs: q.extend(e.generate(prompts, [SamplingParams(
            max_tokens=o, temperature=0, ignore_eos=True) for o in outs])), repeats=1, warmup=0)
        assert [len(q.output_ids) for q in seqs] == outs
        rows.append({"section": "serve", "contender": f"hyla engine ({mode})",
                     "requests": len(prompts), "prompt_tokens": sum(lens),
                     "output_tokens": sum(outs), "seconds": sec,
                     "output_tok_per_s": sum(outs) / sec, "warmup_s": warm,
                     "captures": eng.runner.num_captures, "capture_failures":
                     eng.runner.graphs.capture_failures if eng.runner.graphs else 0})
    try:
        hf = llama_like(model.cfg).to(dev, next(model.parameters()).dtype)
    except ImportError as e:
        return rows + [{"section": "serve", "contender": "transformers generate",
                        "skipped": str(e)}]

    def generate():
        for i in range(0, len(prompts), 32):
            ps, width, n = prompts[i:i + 32], max(map(len, prompts[i:i + 32])), max(outs[i:i + 32])
            ids, mask = torch.zeros(2, len(ps), width, dtype=torch.long)
            for b, p in enumerate(ps):
                ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
            with torch.no_grad():
                hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)
    sec = time_fn(generate, repeats=1, warmup=0)
    for r in rows:
        r["vs_transformers"] = r["output_tok_per_s"] * sec / sum(outs)
    return rows + [{"section": "serve", "contender": "transformers generate (batches of 32)",
                    "requests": len(prompts), "output_tokens": sum(outs), "seconds": sec,
                    "output_tok_per_s": sum(outs) / sec}]


def decode_vs_context(s, dev) -> list[dict]:
    """A decode step of ``decode_batch`` sequences by context, GLA-only and the preset's
    hybrid, eager and CUDA graphs (states and KV zeros: the cost does not depend on them)."""
    rows, B, bs = [], s.decode_batch, 16
    for layers in ("G" * len(preset(s.decode_preset).layers), None):
        model, first = model_on(s.decode_preset, dev, layers), None
        for ctx in s.decode_contexts:
            row, nblk = {"section": "decode", "layers": model.cfg.layers, "batch": B,
                         "context": ctx}, ctx // bs + 1
            for mode in ("eager", "cuda_graphs"):
                r = Runner(model, max_num_seqs=B, num_kv_blocks=B * nblk, block_size=bs,
                           cuda_graphs=mode == "cuda_graphs", capture=capture(dev))
                args = (list(range(B)), [1] * B, [ctx] * B,
                        [list(range(b * nblk, (b + 1) * nblk)) for b in range(B)], B)
                row[f"{mode}_tok_per_s"] = B / time_fn(lambda r=r, a=args: r.decode(*a),
                                                       repeats=max(3, s.repeats), warmup=2)
                del r
            first = first or row
            row["graphs_speedup"] = row["cuda_graphs_tok_per_s"] / row["eager_tok_per_s"]
            row["eager_vs_shortest"] = row["eager_tok_per_s"] / first["eager_tok_per_s"]
            rows.append(row)
    return rows


SECTIONS = {"ops": check_ops, "gla_speed": gla_speed, "streamkl_speed": streamkl_speed,
            "train": train_step, "serve": serving, "decode": decode_vs_context}


def main(run) -> None:
    dry = run.args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU check")
    dev, sizes = torch.device("cpu" if dry else "cuda"), DRY if dry else FULL
    if bad := set(names := run.args.sections.split(",")) - set(SECTIONS):
        raise SystemExit(f"--sections: unknown {sorted(bad)}; known {sorted(SECTIONS)}")
    rows, sections = [], {}
    for name in names:
        t0 = time.perf_counter()
        run.progress(name)
        try:
            new = SECTIONS[name](SimpleNamespace(**sizes), dev)
            bad = sum(r.get("ok") is False for r in new)
            status = f"{bad} row(s) outside their error bound" if bad else "ok"
        except Exception as e:  # noqa: BLE001 - record it, go on with the other sections
            new, status = [], f"error: {type(e).__name__}: {e}"
            traceback.print_exc()
        sections[name] = {"status": status, "seconds": time.perf_counter() - t0}
        rows += new
        if new:
            keys = dict.fromkeys(k for r in new for k in r if k not in ("section", "errors"))
            run.table(name, [{k: r.get(k, "") for k in keys} for r in new])
        # after every section: a run cut short still leaves a record of what it reached
        run.save(rows, name="gpu_check_dry" if dry else "gpu_check", dry_run=dry,
                 device=str(dev), gpu=torch.cuda.get_device_name() if not dry else None,
                 sizes=sizes, sections=sections, summary="GPU check sections: " + ", ".join(
                     f"{k} {v['status']}" for k, v in sections.items()))
    run.table("gpu_check sections", [{"section": k, **v} for k, v in sections.items()])
    if any(v["status"] != "ok" for v in sections.values()):
        raise SystemExit(1)
