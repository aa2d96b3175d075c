"""Single-request decode got faster: KV read in place, in bf16, and against earlier revisions.

SmolLM2-135M Q4_1, one request, per scheme and prompt, decode tok/s after the first token by
wall and CPU time, alternating ``--rounds``: ``before`` keeps KV in the model's dtype and
gathers it every step, ``after`` reads it in place in ``--kv-cache-dtype``; with ``--base REV``
instead that revision's ``hyla`` (``git archive``: no git state changes) against the working
tree, each in a fresh process, also through ``generate_text`` (CPU time). ``--profile``: self
CPU by op. ``--quick``: 64-token prompt, 16 tokens, 2 rounds (1 with ``--base``).
"""

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.serve_common import ROOT, decode_rate, engine, revision_tree, tree_env
from hyla.model.load import load_model
from hyla.model.quantize import quantize_model

CHILD = (f"import sys; sys.path.append({str(ROOT)!r}); "
         "from benchmarks.engine_decode import workload; workload(*sys.argv[1:])")


def add_args(p) -> None:
    p.add_argument("--base", metavar="REV", help="before: this git revision (default: old path)")
    p.add_argument("--schemes", default="none,int8,int4", help="comma-separated (%(default)s)")
    p.add_argument("--prompts", default="128,1024", help="prompt lengths (%(default)s)")
    p.add_argument("--tokens", type=int, default=48, help="tokens a request (%(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the after engine's KV dtype (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="profile one decode a scheme")


def quantized(base, schemes: str):
    for scheme in schemes.split(","):
        quantize_model(model := copy.deepcopy(base), scheme)
        yield scheme, model


def workload(schemes: str, prompts: str, tokens: str) -> None:
    """``--base``: one tree's figures, in a child process with that tree first on the path."""
    from hyla.cli.common import generate_text

    torch.set_num_threads(1)
    tokens, (base, tok), out = int(tokens), load_model("smollm2"), {}

    def gen_cpu(model, text, n):
        c = time.thread_time()
        generate_text(model, tok, text, argparse.Namespace(max_tokens=n, temperature=0.0,
                                                           top_k=None, top_p=1.0, seed=0))
        return time.thread_time() - c

    for scheme, model in quantized(base, schemes):
        for n in map(int, prompts.split(",")):
            ids = [(17 + 31 * i) % model.cfg.vocab_size for i in range(n)]
            eng = engine(model, max_num_seqs=1, max_model_len=n + tokens + 16)
            decode_rate(eng, ids, tokens)                 # warm-up; the prompt is cached after
            rates = [decode_rate(eng, ids, tokens) for _ in range(2)]
            gen_cpu(model, text := tok.decode(ids), 2)    # warm-up
            one, full = gen_cpu(model, text, 1), gen_cpu(model, text, tokens)
            out[f"{scheme}/{n}/engine"] = [statistics.median(r[i] for r in rates) for i in (0, 1)]
            out[f"{scheme}/{n}/generate"] = [None, (tokens - 1) / max(full - one, 1e-9)]
    print("RESULT " + json.dumps(out))


def on_tree(tree, a) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, a.schemes, a.prompts, str(a.tokens)],
                          env=tree_env(tree), cwd=tempfile.gettempdir(), capture_output=True,
                          text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"workload failed on {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def row(key: str, got: dict, **extra) -> dict:
    """Medians of (wall, CPU) tok/s over rounds, before and after."""
    (bw, bc), (aw, ac) = ([None if r[0][i] is None else statistics.median(x[i] for x in r)
                           for i in (0, 1)] for r in (got["before"], got["after"]))
    scheme, prompt, path = key.split("/")
    return {"quantize": scheme, "prompt": int(prompt), "path": path, "before_tok_s": bw,
            "after_tok_s": aw, "before_cpu_tok_s": bc, "after_cpu_tok_s": ac,
            "speedup_cpu": ac / bc, **extra}


def profile(eng, prompt: list[int], tokens: int) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decode_rate(eng, prompt, 4)     # the prompt in the prefix cache: mostly decode below
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_rate(eng, prompt, tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key[:48], "calls": e.count, "share": e.self_cpu_time_total / total,
             "self_ms_per_token": e.self_cpu_time_total / 1e3 / tokens} for e in events[:12]]


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    if a.quick:
        a.prompts, a.tokens, a.rounds = "64", 16, 1 if a.base else 2
    rows, profiles = [], {}
    if a.base:
        with tempfile.TemporaryDirectory() as tmp:
            trees = {"before": revision_tree(a.base, tmp), "after": ROOT}
            got = run.rounds({k: lambda t=t: on_tree(t, a) for k, t in trees.items()})
        rows = [row(key, {k: [x[key] for x in v] for k, v in got.items()})
                for key in got["before"][0]]
    for scheme, model in [] if a.base else quantized(load_model("smollm2")[0], a.schemes):
        for n in map(int, a.prompts.split(",")):
            run.progress(f"{scheme}, {n}-token prompt")
            prompt, engines = [(17 + 31 * i) % model.cfg.vocab_size for i in range(n)], {}
            for v in ("before", "after"):
                engines[v] = engine(model, max_num_seqs=1, max_model_len=n + a.tokens + 16,
                                    kv_cache_dtype=a.kv_cache_dtype if v == "after" else None)
                engines[v].runner.kv_in_place = v == "after"
                decode_rate(engines[v], prompt, 4)          # warm-up, and the prompt cached
            rows.append(row(f"{scheme}/{n}/engine", run.rounds({
                v: lambda e=e, p=prompt: decode_rate(e, p, a.tokens)
                for v, e in engines.items()}), kv=str(engines["after"].runner.kv_dtype)[6:]))
            if a.profile and not profiles.get(scheme):
                profiles[scheme] = profile(engines["after"], prompt, a.tokens)
                run.table(f"after, {scheme}, prompt {n}: self CPU by op", profiles[scheme])
    run.table(f"single-request decode tok/s, before ({a.base or 'KV gathered'}) vs after", rows)
    name = "decode_vs_revision" if a.base else "engine_decode"
    run.save(rows, name=name + "_quick" * a.quick, profiles=profiles, base=a.base,
             tokens=a.tokens, kv_cache_dtype=a.kv_cache_dtype, summary=f"decode after / before "
             f"({a.base or 'KV gathered'}), CPU time: " + ", ".join(
                 f"{r['quantize']} {r['path']} at {r['prompt']} {r['speedup_cpu']:.2f}x"
                 for r in rows))
