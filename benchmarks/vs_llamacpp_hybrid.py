"""hyla serve vs llama-server on hybrid GGUFs: Qwen3.5 4.7x decode; Granite 0.4x, 1.1x at 16K.

Random-weight checkpoints of two shipped hybrids' shapes (weights do not change speed): a
Qwen3.5-0.8B (hidden 1024; 24 layers, 3 gated-DeltaNet to 1 gated attention; 16 QK and 16 V
delta heads of 128; 8 query / 2 KV attention heads of 256; FFN 3584; vocabulary 248,320;
tied) and a Granite-4.0-H-350M (hidden 768; 32 layers, 28 Mamba-2 and 4 NoPE attention;
48 SSM heads of 32, state 128, one group; 12 / 4 attention heads; FFN 2048; vocabulary
100,352; tied), as their model cards give them. SmolLM2's tokenizer stands in for theirs (one
llama.cpp's converter recognises; the vocabulary is padded to the model's size). Converted
by llama.cpp's ``convert_hf_to_gguf.py`` to Q8_0, and to Q4_0 by ``llama-quantize``. Each
file served by both servers in alternating rounds: start-up, memory, decode, ~1K-token
prefill and 16 concurrent requests (as ``vs_llamacpp``), then one request's decode after 1K
and 16K prompt tokens and the prefill time of 1K and 8K. ``--quick``: Granite, Q8_0, one
round, no long context.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import time

import httpx
import torch

from benchmarks import vs_llamacpp as vs
from benchmarks.serve_common import server

WORK = pathlib.Path.home() / ".cache" / "hyla" / "bench-hybrids"
SHAPES = {
    "qwen3.5-0.8b": ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=65536,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25})),
    "granite-4.0-h-350m": ("granitemoehybrid", "GraniteMoeHybridForCausalLM",
                           "GraniteMoeHybridConfig", dict(
        vocab_size=100352, hidden_size=768, intermediate_size=2048, num_hidden_layers=32,
        num_attention_heads=12, num_key_value_heads=4, num_local_experts=0,
        num_experts_per_tok=0, shared_intermediate_size=2048,
        mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope",
        tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.246,
        attention_multiplier=0.0078125, logits_scaling=3.0,
        layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(32)]))}
LONG = (1024, 16384)
PREFILL = (1024, 8192)


def add_args(p) -> None:
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"], help="GGUF types")
    p.add_argument("--compile", action="store_true", help="hyla serve --compile")
    p.add_argument("--skip-long", action="store_true", help="no long-context rows")


def checkpoint(name: str) -> pathlib.Path:
    """The random-weight transformers directory of ``name`` (made once, cached)."""
    d = WORK / name
    if (d / "config.json").is_file():
        return d
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import transformers
    from hf_reference import reference  # transformers' torch path, fla hidden

    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.formats.hf.tokenizer import save_hf_tokenizer
    from hyla.model.names import resolve_name

    module, cls, config, kw = SHAPES[name]
    torch.manual_seed(0)
    model = getattr(reference(module), cls)(getattr(transformers, config)(**kw))
    model.save_pretrained(d)
    save_hf_tokenizer(load_gguf_tokenizer(resolve_name("smollm2")), d)
    if "layer_types" in kw and module == "granitemoehybrid":   # the converter reads these
        cfg = json.loads((d / "config.json").read_text())
        cfg["layer_types"] = kw["layer_types"]
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def gguf(name: str, kind: str) -> pathlib.Path:
    """``name`` as a GGUF of ``kind`` (Q8_0 by the converter, others by llama-quantize)."""
    out = WORK / f"{name}.{kind}.gguf"
    if out.is_file():
        return out
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from llama_cpp import convert, fetch

    fetch()
    q8 = WORK / f"{name}.Q8_0.gguf"
    if not q8.is_file():
        extra = ("--no-mtp",) if name.startswith("qwen") else ()
        convert(checkpoint(name), q8, "q8_0", *extra)
    if kind != "Q8_0":
        tool = vs.llama_server().parent / "llama-quantize"
        subprocess.run([str(tool), "--allow-requantize", str(q8), str(out), kind], check=True,
                       capture_output=True)
    return out


def long_row(kind: str, path: pathlib.Path, a) -> dict:
    """One request: decode tok/s of 32 tokens after LONG prompt tokens; prefill seconds of
    PREFILL prompt tokens (to the first token)."""
    ctx = str(max(LONG) + 1024)
    cmd = vs.command(kind, path, a, ("-np", "1", "-c", ctx),
                     ("--max-num-seqs", "1", "--max-model-len", ctx, "--quantize", "auto"))
    words = ("harbour", "lantern", "granite", "meadow", "copper", "thistle", "orchard", "falcon")
    row, began = {}, time.perf_counter()
    with server(cmd) as (_, url, _, _):
        vs.ready(url, began, [1] if kind != "llama.cpp" and a.compile else None)
        for n in sorted({*LONG, *PREFILL}):
            text = " ".join(f"Entry {i}: the {words[i % 8]} by the {words[(i * 3 + 1) % 8]} "
                            "was noted." for i in range(n // 14))
            ttft, dt, got = vs.stream_times(url, f"{time.time_ns()} {text}\nSummary:",
                                            32 if n in LONG else 1)
            if n in LONG:
                row[f"decode_tok_s_{n // 1024}k"] = (got - 1) / dt if got > 1 else float("nan")
            if n in PREFILL:
                row[f"prefill_s_{n // 1024}k"] = ttft
    return row


def main(run) -> None:
    a = run.args
    models = ["granite-4.0-h-350m"] if a.quick else a.models
    types = ["Q8_0"] if a.quick else a.types
    a.quantize = ["auto"]           # what vs_llamacpp's rounds read
    rows, runs = [], {}
    for name in models:
        for kind in types:
            run.progress(f"{name} {kind}: the file")
            path = gguf(name, kind)
            got = run.rounds({k: lambda k=k, p=path: vs.one_round(k, p, a)
                              for k in ("llama.cpp", "hyla auto")}, 1 if a.quick else None)
            for server_kind, values in got.items():
                row = {"model": name, "type": kind, "server": server_kind,
                       **{key: statistics.median(v[key] for v in values) for key in values[0]}}
                if not (a.quick or a.skip_long):
                    run.progress(f"{name} {kind} {server_kind}: long context")
                    try:
                        row |= long_row(server_kind.removesuffix(" auto"), path, a)
                    except httpx.HTTPStatusError as e:
                        row["long_error"] = f"{e.response.status_code}: {e.response.text[:200]}"
                rows.append(row)
            runs[f"{name} {kind}"] = got
    ratios = []
    for llama, hyla in zip(rows[::2], rows[1::2], strict=True):
        ratios.append({"model": hyla["model"], "type": hyla["type"], **{
            k: hyla[k] / llama[k] for k in hyla
            if k not in ("model", "type", "server") and isinstance(hyla[k], float)
            and k in llama and llama[k]}})
    run.table("medians (tok/s, MB, s)", rows)
    run.table("hyla / llama.cpp", ratios)
    run.save(rows, runs=runs, ratios=ratios, threads=1, summary="; ".join(
        f"{r['model']} {r['type']}: decode {r['decode_tok_s']:.2f}x"
        + (f" ({r['decode_tok_s_16k']:.2f}x at 16K)" if "decode_tok_s_16k" in r else "")
        + f", prefill {r['prefill_tok_s']:.2f}x, 16 concurrent {r['concurrent16_tok_s']:.2f}x,"
        f" memory {r['rss_after_mb']:.2f}x" for r in ratios))
