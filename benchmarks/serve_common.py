"""Shared pieces of the serving benchmarks: the trace workload and model builders."""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import random

import torch

from hyla.disagg.sim.traces import trace_path
from hyla.model import HylaLM, preset

TRACE = trace_path("azure-conv")  # the Azure conversation trace that ships with hyla


def trace_workload(n: int, length_scale: float, seed: int = 0,
                   path: pathlib.Path = TRACE) -> list[tuple[int, int, float]]:
    """``n`` requests (prompt tokens, output tokens, arrival s) drawn from the Azure
    conversation trace with lengths divided by ``length_scale`` (at least 1 token)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    picked = rng.sample(rows, n)
    return [(max(1, round(int(r["num_prefill_tokens"]) / length_scale)),
             max(1, round(int(r["num_decode_tokens"]) / length_scale)),
             float(r["arrived_at"])) for r in picked]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hyla_model(name: str = "small", layers: str | None = None, seed: int = 0) -> HylaLM:
    cfg = preset(name)
    if layers is not None:
        cfg = dataclasses.replace(cfg, layers=layers)
    torch.manual_seed(seed)
    return HylaLM(cfg).eval()


def llama_like(cfg, seed: int = 0):
    """A Hugging Face Llama of the same width, depth, heads and vocabulary as ``cfg``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    lc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                     intermediate_size=cfg.ffn_dim, num_hidden_layers=len(cfg.layers),
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                     max_position_embeddings=8192, tie_word_embeddings=cfg.tie_embeddings,
                     eos_token_id=None, pad_token_id=0, bos_token_id=None)
    return LlamaForCausalLM(lc).eval()
