"""The GPU check (issue 20): everything hyla claims about a GPU, measured in one run.

Run through ``bash benchmarks/gpu_check.sh`` (which installs what is missing first); on one
H200 it is sized to finish in under 8 minutes. Sections, each timed and recorded even when
another fails:

- ``ops``: every op on the device (GLA chunk + recurrent, gated delta per head and per key
  channel, attention, StreamKL, Newton-Schulz; auto-selected backend and native) against
  its fp32 CPU reference: relative RMS error of the output, the final state and every
  gradient, with DESIGN.md's bounds (5e-3 bf16, 1e-5 fp32), mild and harsh gates;
- ``gla_speed``: ``chunk_gla`` native vs fla vs causal SDPA (flash), forward and
  forward + backward, bf16, B 1, H 16, K = V = 128, T = 4K ... 32K;
- ``streamkl_speed``: StreamKL triton vs chunk vs materialised, forward and forward +
  backward, N = 4K ... 32K (materialised only where it fits);
- ``train``, ``serve``, ``decode``: :mod:`gpu_check_serve`.

``--dry-run`` runs the same code on the CPU at tiny shapes (what CI runs): kernels that need
CUDA are recorded as skipped with the reason, CUDA graphs use a stand-in capture.

    python benchmarks/gpu_check.py [--dry-run] [--sections ops,gla_speed,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import gpu_check_serve  # noqa: E402

from hyla.ops.attention import attention  # noqa: E402
from hyla.ops.backends import select  # noqa: E402
from hyla.ops.deltanet import (  # noqa: E402
    chunk_gated_delta,
    naive_recurrent_gated_delta,
    recurrent_gated_delta,
)
from hyla.ops.gla import chunk_gla, naive_recurrent_gla, recurrent_gla  # noqa: E402
from hyla.ops.newton_schulz import newton_schulz  # noqa: E402
from hyla.ops.streamkl import attention_kl, naive_attention_kl  # noqa: E402
from hyla.perf import RESULTS_DIR, machine_info, print_table, time_fn  # noqa: E402


@dataclass
class Sizes:
    """Every shape the check uses; ``full`` for an H200, ``dry`` for a CPU in seconds."""

    ops_T: int
    ops_H: int
    ops_D: int
    gla_T: tuple[int, ...]
    gla_H: int
    gla_D: int
    kl_N: tuple[int, ...]
    kl_H: int
    kl_D: int
    kl_naive_max: int
    repeats: int
    train_preset: str
    train_batch: int
    train_len: int
    train_steps: int
    serve_requests: int
    serve_length_scale: float
    serve_max_seqs: int
    decode_preset: str
    decode_batch: int
    decode_contexts: tuple[int, ...]
    peak_size: int


FULL = Sizes(ops_T=300, ops_H=4, ops_D=64, gla_T=(4096, 8192, 16384, 32768), gla_H=16,
             gla_D=128, kl_N=(4096, 8192, 16384, 32768), kl_H=8, kl_D=64,
             kl_naive_max=16384, repeats=3, train_preset="small", train_batch=8,
             train_len=2048, train_steps=5, serve_requests=64, serve_length_scale=1.0,
             serve_max_seqs=64, decode_preset="small", decode_batch=4,
             decode_contexts=(1024, 4096, 16384, 32768), peak_size=8192)
DRY = Sizes(ops_T=37, ops_H=2, ops_D=16, gla_T=(64, 128), gla_H=2, gla_D=16, kl_N=(64, 128),
            kl_H=2, kl_D=16, kl_naive_max=128, repeats=1, train_preset="debug",
            train_batch=2, train_len=64, train_steps=1, serve_requests=3,
            serve_length_scale=64.0, serve_max_seqs=2, decode_preset="debug", decode_batch=2,
            decode_contexts=(16, 48), peak_size=128)

BOUND = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-5}


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double().cpu(), x.detach().double().cpu()
    den = ref.norm().item()
    return (ref - x).norm().item() / den if den > 0 else (x.norm().item())


# ------------------------------------------------------------------------------- ops

def _gla_inputs(s: Sizes, harsh: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, D = 2, s.ops_T, s.ops_H, s.ops_D
    q, k, v = torch.randn(3, B, T, H, D, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen)) / (1 if harsh else 16)
    return q, k, v, g, torch.randn(B, H, D, D, generator=gen)


def _grads(fn, leaves, cot):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    outs = fn(*leaves)
    torch.autograd.backward([o for o in outs if o is not None],
                            [c.to(o.device, o.dtype) for o, c in zip(outs, cot, strict=True)
                             if o is not None])
    return [o.detach() for o in outs if o is not None], [x.grad for x in leaves]


def _compare(name, backend, dtype, gate, ref, got) -> dict:
    (ref_o, ref_g), (o, g) = ref, got
    errs = {f"out{i}": rel_rms(a, b) for i, (a, b) in enumerate(zip(ref_o, o, strict=True))}
    errs |= {f"d{i}": rel_rms(a, b) for i, (a, b) in enumerate(zip(ref_g, g, strict=True))
             if a is not None and b is not None}
    worst = max(errs.values())
    return {"section": "ops", "op": name, "backend": backend, "dtype": str(dtype)[6:],
            "gates": gate, "max_rel_rms": worst, "bound": BOUND[dtype],
            "ok": bool(worst < BOUND[dtype]), "errors": errs}


def check_ops(s: Sizes, dev: torch.device) -> list[dict]:
    # Every random input below is drawn from seeded generators, so the errors (bf16 ones sit
    # within 10-20% of their bound) are the same from run to run.
    torch.manual_seed(0)
    rows = []
    dtypes = (torch.bfloat16, torch.float32)
    backends = ("auto", "native")
    for harsh in (False, True):
        gate = "harsh" if harsh else "mild"
        q, k, v, g, h0 = _gla_inputs(s, harsh, seed=1)
        cot = (torch.randn_like(v), torch.randn_like(h0))

        def rounded(dtype, *xs):
            """The inputs as the op in ``dtype`` sees them, in fp32: the reference measures
            the op's error, not the rounding of its inputs (as tests/ops do)."""
            return [x.to(dtype).float() for x in xs]

        beta = torch.rand(q.shape[:3])
        qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        for per_channel in (False, True):
            gd = g if per_channel else g.mean(-1)
            kind = "kda" if per_channel else "gdn"
            for dtype in dtypes:
                qr, kr, vr, br = rounded(dtype, qn, kn, v, beta)
                dref = _grads(lambda q, k, v, g, b, h: naive_recurrent_gated_delta(
                    q, k, v, g, b, initial_state=h, output_final_state=True),
                    (qr, kr, vr, gd, br, h0), cot)
                for backend in backends:
                    if backend == "auto" and dev.type != "cuda":
                        continue                   # auto is native off CUDA: run once
                    def run(q, k, v, g, b, h, backend=backend):
                        return chunk_gated_delta(q, k, v, g, b, initial_state=h,
                                                 output_final_state=True, backend=backend)
                    leaves = [x.to(dev, dtype) for x in (qn, kn, v)] + [
                        gd.to(dev), beta.to(dev, dtype), h0.to(dev)]
                    rows.append(_case("chunk_gated_delta", kind, run, leaves, dtype, gate,
                                      dref, cot))
        for dtype in dtypes:
            ref = _grads(lambda q, k, v, g, h: naive_recurrent_gla(
                q, k, v, g, initial_state=h, output_final_state=True),
                (*rounded(dtype, q, k, v), g, h0), cot)
            for backend in backends:
                if backend == "auto" and dev.type != "cuda":
                    continue
                def run(q, k, v, g, h, backend=backend):
                    return chunk_gla(q, k, v, g, initial_state=h, output_final_state=True,
                                     backend=backend)
                leaves = [x.to(dev, dtype) for x in (q, k, v)] + [g.to(dev), h0.to(dev)]
                rows.append(_case("chunk_gla", None, run, leaves, dtype, gate, ref, cot))
    rows += _check_decode_ops(s, dev)
    rows += _check_other_ops(s, dev)
    return rows


def _name(op, run, leaves) -> str:
    """The backend that ``run`` (with its ``backend`` default) resolves to."""
    forced = run.__defaults__[0]
    return select(op, tuple(leaves), {}, None if forced == "auto" else forced)


def _case(op, kind, run, leaves, dtype, gate, ref, cot) -> dict:
    """One op run on the device against the CPU reference, or why it could not run."""
    label = op if kind is None else f"{op}({kind})"
    try:
        return _compare(label, _name(op, run, leaves), dtype, gate, ref,
                        _grads(run, leaves, cot))
    except ValueError as e:          # a forced backend that cannot run here
        return {"section": "ops", "op": label, "backend": run.__defaults__[0],
                "dtype": str(dtype)[6:], "gates": gate, "skipped": str(e)}


def _check_decode_ops(s: Sizes, dev) -> list[dict]:
    """The decode forms (few tokens, no gradient) from a random state, auto backend."""
    rows = []
    q, k, v, g, h0 = _gla_inputs(s, False, seed=2)
    q, k, v, g = (x[:, :4] for x in (q, k, v, g))
    with torch.no_grad():
        ref = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        beta = torch.rand(q.shape[:3])
        qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        dref = naive_recurrent_gated_delta(qn, kn, v, g.mean(-1), beta, initial_state=h0,
                                           output_final_state=True)
        for dtype in (torch.bfloat16, torch.float32):
            args = [x.to(dev, dtype) for x in (q, k, v)] + [g.to(dev)]
            state = h0.to(dev)
            o, ht = recurrent_gla(*args, initial_state=state, output_final_state=True)
            rows.append(_compare("recurrent_gla", select("recurrent_gla", tuple(args), {}),
                                 dtype, "mild", (list(ref), []), ([o, ht], [])))
            dargs = [x.to(dev, dtype) for x in (qn, kn, v)] + [g.mean(-1).to(dev),
                                                               beta.to(dev, dtype)]
            o, ht = recurrent_gated_delta(*dargs, initial_state=h0.to(dev),
                                          output_final_state=True)
            rows.append(_compare("recurrent_gated_delta(gdn)",
                                 select("recurrent_gated_delta", tuple(dargs), {}), dtype,
                                 "mild", (list(dref), []), ([o, ht], [])))
    return rows


def _check_other_ops(s: Sizes, dev) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(3)
    B, T, H, D = 2, s.ops_T, s.ops_H, s.ops_D
    q = torch.randn(B, T, H, D, generator=gen)
    k, v = torch.randn(2, B, T, max(1, H // 2), D, generator=gen)
    cot = (torch.randn(B, T, H, D, generator=gen),)
    ref = _grads(lambda q, k, v: (attention(q, k, v),), (q, k, v), cot)
    qs, ks = torch.randn(B, T, H, D // 2, generator=gen), torch.randn(B, T, 1, D // 2,
                                                                        generator=gen)
    kl_cot = (torch.randn(B, H, T, generator=gen),)

    def kl(q_t, k_t, q_s, k_s):
        return (attention_kl(q_t, k_t, q_s, k_s, reduction="none"),)

    kl_ref = _grads(lambda *a: (naive_attention_kl(*a, reduction="none"),), (q, k, qs, ks),
                    kl_cot)
    m = torch.randn(3, 4 * D, 2 * D, generator=gen)
    ns_ref = newton_schulz(m, dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        got = _grads(lambda q, k, v: (attention(q, k, v),), [x.to(dev, dtype) for x in (q, k, v)],
                     cot)
        rows.append(_compare("attention", "sdpa", dtype, "-", ref, got))
        leaves = [x.to(dev, dtype) for x in (q, k, qs, ks)]
        name = "triton" if dev.type == "cuda" else "chunk"
        rows.append(_compare("attention_kl", name, dtype, "-", kl_ref, _grads(kl, leaves,
                                                                              kl_cot)))
        o = newton_schulz(m.to(dev), dtype=dtype)
        row = _compare("newton_schulz", "native", dtype, "-", ([ns_ref], []), ([o], []))
        # bf16 iterations drift from fp32 ones by design (Muon tolerates it): report only
        row["ok"] = row["ok"] or dtype == torch.bfloat16
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- speed

def gla_speed(s: Sizes, dev) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, D = s.gla_H, s.gla_D
    for T in s.gla_T:
        gen = torch.Generator(device=dev).manual_seed(T)
        q, k, v = torch.randn(3, 1, T, H, D, device=dev, generator=gen).to(dtype)
        g = F.logsigmoid(torch.randn(1, T, H, D, device=dev, generator=gen)) / 16
        do = torch.randn_like(v)
        fns = {"native": lambda q, k, v, g: chunk_gla(q, k, v, g, backend="native")[0],
               "fla": lambda q, k, v, g: chunk_gla(q, k, v, g, backend="fla")[0],
               "sdpa": lambda q, k, v, g: F.scaled_dot_product_attention(
                   q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   is_causal=True).transpose(1, 2)}
        row = {"section": "gla_speed", "T": T, "H": H, "K=V": D, "dtype": str(dtype)[6:]}
        for name, fn in fns.items():
            row |= _time_pair(name, fn, (q, k, v, g), do, s.repeats)
        for mode in ("fwd", "fwd_bwd"):
            for other in ("native", "sdpa"):
                a, b = row.get(f"{other}_{mode}_ms"), row.get(f"fla_{mode}_ms")
                if isinstance(a, float) and isinstance(b, float):
                    row[f"fla_vs_{other}_{mode}"] = a / b
        rows.append(row)
    return rows


def _time_pair(name, fn, inputs, do, repeats) -> dict:
    """Forward and forward + backward milliseconds of ``fn``, or why it did not run."""
    out = {}
    try:
        with torch.no_grad():
            out[f"{name}_fwd_ms"] = time_fn(lambda: fn(*inputs), repeats=repeats) * 1e3
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]

        def step():
            fn(*leaves).backward(do)
        out[f"{name}_fwd_bwd_ms"] = time_fn(step, repeats=repeats) * 1e3
    except ValueError as e:
        out[f"{name}_fwd_ms"] = f"skipped: {str(e)[:80]}"
    except torch.cuda.OutOfMemoryError:
        out.setdefault(f"{name}_fwd_ms", "oom")
        out[f"{name}_fwd_bwd_ms"] = "oom"
        torch.cuda.empty_cache()
    return out


def streamkl_speed(s: Sizes, dev) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for N in s.kl_N:
        gen = torch.Generator(device=dev).manual_seed(N)
        q_t, k_t, q_s, k_s = torch.randn(4, 1, N, s.kl_H, s.kl_D, device=dev,
                                         generator=gen).to(dtype)
        row = {"section": "streamkl_speed", "N": N, "H": s.kl_H, "D": s.kl_D,
               "dtype": str(dtype)[6:]}
        for name in ("triton", "chunk", "naive"):
            if name == "naive" and N > s.kl_naive_max:
                row["naive_fwd_ms"] = "skipped: the N x N matrices do not fit"
                continue
            if name == "triton" and dev.type != "cuda":
                row["triton_fwd_ms"] = "skipped: needs CUDA"
                continue

            def fn(q_t, k_t, q_s, k_s, name=name):
                return attention_kl(q_t, k_t, q_s, k_s, backend=name)
            row |= _time_pair(name, fn, (q_t, k_t, q_s, k_s), torch.ones((), device=dev),
                              s.repeats)
        for mode in ("fwd", "fwd_bwd"):
            for other in ("chunk", "naive"):
                a, b = row.get(f"{other}_{mode}_ms"), row.get(f"triton_{mode}_ms")
                if isinstance(a, float) and isinstance(b, float):
                    row[f"triton_vs_{other}_{mode}"] = a / b
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- driver

SECTIONS = {"ops": check_ops, "gla_speed": gla_speed, "streamkl_speed": streamkl_speed,
            "train": gpu_check_serve.train_step, "serve": gpu_check_serve.serving,
            "decode": gpu_check_serve.decode_vs_context}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                                               "gpu_check.json, gpu_check_dry.json dry)")
    args = p.parse_args(argv)
    sizes = DRY if args.dry_run else FULL
    if args.dry_run:
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    out = args.out or str(RESULTS_DIR / ("gpu_check_dry.json" if args.dry_run
                                         else "gpu_check.json"))
    record = {"machine": machine_info(), "dry_run": args.dry_run, "device": str(dev),
              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
              "sizes": asdict(sizes), "sections": {}, "rows": []}
    failed = []
    t_all = time.perf_counter()
    for name in args.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--sections: unknown {name!r}; known {sorted(SECTIONS)}")
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            rows = SECTIONS[name](sizes, dev)
            status = "ok"
            bad = [r for r in rows if r.get("ok") is False]
            if bad:
                status = f"{len(bad)} row(s) outside their error bound"
        except Exception as e:  # noqa: BLE001 - record it, go on with the other sections
            rows, status = [], f"error: {type(e).__name__}: {e}"
            traceback.print_exc()
        if status != "ok":
            failed.append(name)
        record["sections"][name] = {"status": status, "seconds": time.perf_counter() - t0}
        record["rows"] += rows
        _summary(name, rows)
        _write(out, record | {"total_seconds": time.perf_counter() - t_all})
    print_table("gpu_check sections", [{"section": k, **v}
                                       for k, v in record["sections"].items()])
    print(f"wrote {out} ({time.perf_counter() - t_all:.1f} s)")
    return 1 if failed else 0


def _summary(name: str, rows: list[dict]) -> None:
    if not rows:
        return
    if name == "ops":
        rows = [{k: v for k, v in r.items() if k not in ("section", "errors")} for r in rows]
    else:
        rows = [{k: v for k, v in r.items() if k != "section"} for r in rows]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print_table(name, [{k: r.get(k, "") for k in keys} for r in rows])


def _write(path: str, record: dict) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(record), f, indent=1, default=str)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
