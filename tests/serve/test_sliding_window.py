"""Sliding-window attention in the serving engine: greedy-equal to the model's own loop
(chunked prefill, queueing, preemption, prefix-cache hits), with each window layer's keys
in a ring of its slot, so its memory stays flat however long the context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

WINDOW, BLOCK = 10, 4
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _model(layers: str, window: int | None = WINDOW):
    """``layers`` with ``window``; a lower-case ``a`` is a full-attention layer among them."""
    torch.manual_seed(0)
    full = [{"sliding_window": None} if c == "a" else {} for c in layers]
    cfg = dataclasses.replace(preset("debug"), layers=layers.upper(), sliding_window=window,
                              layer_overrides=full if "a" in layers else None)
    return HylaLM(cfg).eval()


def _prompts(n, seed=1, lo=5, hi=60):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (t,), generator=g).tolist() for t in lens]


def test_window_changes_the_model():
    ids = torch.tensor([_prompts(1, lo=40, hi=41)[0]])
    with torch.no_grad():
        assert not torch.allclose(_model("GA")(ids), _model("GA", None)(ids))


@pytest.mark.parametrize("layers", ["GGGA", "AA", "GaGA"])
@pytest.mark.parametrize("cfg", [
    dict(),
    dict(max_num_batched_tokens=12, snapshot_interval=8),      # chunks cross the window
    dict(max_num_seqs=2),
    dict(num_kv_blocks=20, max_num_batched_tokens=64),         # preemption
], ids=["plain", "chunked", "queued", "preempt"])
def test_engine_greedy_matches_model_loop(layers, cfg):
    model = _model(layers)
    prompts = _prompts(6)
    want = [generate(model, p, 16, temperature=0) for p in prompts]
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=96, block_size=BLOCK,
                                                      **cfg))
    seqs = eng.generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == want
    assert eng.scheduler.pool.num_used == 0
    blocks = eng.scheduler.blocks
    assert (blocks is None) == ("a" not in layers)      # only a full layer pages its KV
    if blocks is not None:
        assert all(r == 0 for r in blocks.ref_count)
        if cfg.get("num_kv_blocks"):
            assert eng.scheduler.num_preemptions > 0


def test_window_layers_take_no_blocks_and_flat_memory():
    """GGGA with a window: no KV blocks at all, the ring's bytes in the slot whatever the
    context; GaAA with one full layer: blocks for that layer's context only."""
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, block_size=BLOCK,
                                                      max_num_batched_tokens=16))
    assert eng.scheduler.blocks is None and eng.kv_cache_bytes == 0
    ring = eng.runner.buffers[3]        # the attention layer's: a ring a slot
    assert [tuple(b.shape[1:3]) for b in ring.values()] == [(WINDOW, model.cfg.n_kv_heads)] * 2
    prompts = _prompts(3, lo=50, hi=60)
    seqs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                ignore_eos=True))
    assert [s.output_ids for s in seqs] == [generate(model, p, 40, temperature=0)
                                            for p in prompts]
    mixed = _model("GaAA")
    cfg = mixed.cfg
    full = Engine(mixed, ByteTokenizer(), EngineConfig(max_model_len=128, block_size=BLOCK))
    per_block = full.kv_cache_bytes // full.scheduler.config.num_kv_blocks
    one_layer = BLOCK * 2 * cfg.n_kv_heads * cfg.head_dim * 4     # keys + values, fp32
    assert per_block == one_layer


def test_prefix_cache_hit_with_a_window():
    model = _model("GGGA")
    shared = _prompts(1, seed=3, lo=40, hi=41)[0]
    tails = _prompts(3, seed=4, lo=3, hi=9)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=96, block_size=BLOCK,
                                                      snapshot_interval=16))
    eng.generate([shared + tails[0]], GREEDY)
    seqs = eng.generate([shared + t for t in tails[1:]], GREEDY)
    assert all(s.num_cached_tokens == 32 for s in seqs)
    assert [s.output_ids for s in seqs] == [generate(model, shared + t, 16, temperature=0)
                                            for t in tails[1:]]
