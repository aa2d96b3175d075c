"""What the serving benchmarks share: workloads, models, engines, servers, other revisions.
They run one torch thread unless ``--threads`` says otherwise: on a 2-vCPU VM a second
intra-op thread makes the small ops of a decode step 2-5x slower (docs/results.md)."""

import contextlib
import csv
import dataclasses
import io
import os
import pathlib
import random
import socket
import subprocess
import sys
import tarfile
import time

import torch

from hyla.model import HylaLM, preset
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def trace_workload(n: int, length_scale: float, seed: int = 0) -> list[tuple[int, int, float]]:
    """``n`` requests (prompt tokens, output tokens, arrival s) from the Azure conversation
    trace shipped with hyla, lengths divided by ``length_scale`` (at least 1)."""
    from hyla.disagg.sim.traces import trace_path

    with open(trace_path("azure-conv"), newline="") as f:
        rows = random.Random(seed).sample(list(csv.DictReader(f)), n)
    return [(max(1, round(int(r["num_prefill_tokens"]) / length_scale)),
             max(1, round(int(r["num_decode_tokens"]) / length_scale)),
             float(r["arrived_at"])) for r in rows]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hyla_model(name: str = "small", layers: str | None = None, seed: int = 0) -> HylaLM:
    torch.manual_seed(seed)
    cfg = preset(name)
    return HylaLM(cfg if layers is None else dataclasses.replace(cfg, layers=layers)).eval()


def llama_like(cfg, seed: int = 0):
    """A Hugging Face Llama of the same width, depth, heads and vocabulary as ``cfg``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=len(cfg.layers), num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=8192, pad_token_id=0,
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=None, bos_token_id=None)).eval()


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


def served_smollm2(quantize: str = "auto", dtype=None):
    """SmolLM2-135M-Instruct Q4_1 (in ``dtype``, default its own) quantised as ``hyla serve
    --quantize`` takes it: (model, tokenizer, the scheme run, why it is not the one asked,
    or "")."""
    from hyla.cli.model_flags import resolve_quantize
    from hyla.model.load import load_model
    from hyla.model.quantize import quantize_model

    model, tok = load_model("smollm2")
    model = model if dtype is None else model.to(dtype)
    scheme, why = resolve_quantize(model, quantize)
    quantize_model(model, scheme)
    return model, tok, scheme, why


def engine(model, tokenizer=None, **config) -> Engine:
    return Engine(model, tokenizer, EngineConfig(**config))


def decode_rate(eng: Engine, prompt: list[int], tokens: int,
                params: SamplingParams | None = None) -> tuple[float, float]:
    """Decode tok/s of one request (default: greedy, ``tokens`` of them whatever the model
    says; the tokens after its first), by wall time and by this thread's CPU time (with one
    torch thread, the work itself: steadier under load)."""
    eng.add_request(prompt, params or greedy(tokens))
    first, n = None, 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.token_ids)
            if first is None and o.token_ids:
                first, cpu, n = time.perf_counter(), time.thread_time(), 0
    return n / (time.perf_counter() - first), n / (time.thread_time() - cpu)


def revision_tree(rev: str, dest) -> pathlib.Path:
    """``rev``'s ``hyla`` extracted into ``dest`` by ``git archive`` (no git state changes)."""
    data = subprocess.run(["git", "archive", rev, "hyla"], cwd=ROOT, capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return pathlib.Path(dest)


def tree_env(tree=None) -> dict:
    """A child's environment: one OpenMP thread, ``tree`` (if any) first on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    return env


def hyla_serve(source, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hyla", "serve", "--checkpoint", str(source), "--threads", "1",
            "--log-level", "warning", *extra]


@contextlib.contextmanager
def server(cmd: list[str], tree=None, limit: float = 300.0):
    """Start ``cmd --port P`` on ``tree``, wait for a 200 from its ``/health``, yield (process,
    URL, seconds to its first answer of any status, to the 200); stop it after."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, began, first = f"http://127.0.0.1:{port}", time.perf_counter(), None
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=tree_env(tree), cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                status = httpx.get(url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None
            if (first := first or (status and time.perf_counter() - began)) and status == 200:
                break
            if proc.poll() is not None or time.perf_counter() - began > limit:
                raise SystemExit(f"not healthy (exit status {proc.poll()}): {' '.join(cmd)}")
            time.sleep(0.05)
        yield proc, url, first, time.perf_counter() - began
    finally:
        proc.terminate()
        proc.wait(30)
