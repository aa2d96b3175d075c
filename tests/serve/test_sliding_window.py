"""Sliding-window attention in the serving engine: greedy-equal to the model's own loop
(chunked prefill, queueing, preemption, prefix-cache hits), and KV blocks that left a
sequence's window are released while it runs."""

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
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug"), layers=layers, sliding_window=window)
    return HylaLM(cfg).eval()


def _prompts(n, seed=1, lo=5, hi=60):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (t,), generator=g).tolist() for t in lens]


def test_window_changes_the_model():
    ids = torch.tensor([_prompts(1, lo=40, hi=41)[0]])
    with torch.no_grad():
        assert not torch.allclose(_model("GA")(ids), _model("GA", None)(ids))


@pytest.mark.parametrize("layers", ["GGGA", "AA"])
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
    assert eng.scheduler.config.sliding_window == WINDOW
    seqs = eng.generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == want
    assert all(r == 0 for r in eng.scheduler.blocks.ref_count)
    assert eng.scheduler.pool.num_used == 0
    if cfg.get("num_kv_blocks"):
        assert eng.scheduler.num_preemptions > 0


def test_blocks_out_of_every_window_are_released():
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, block_size=BLOCK,
                                                      max_num_batched_tokens=16))
    prompts = _prompts(3, lo=50, hi=60)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for p in prompts]
    released, most = eng.scheduler.released_block, 0
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            held = [b for b in s.block_table if b != released]
            most = max(most, len(held))
            # everything before the next query's window is gone
            first = max(0, s.num_computed_tokens - WINDOW + 1) // BLOCK
            assert all(b == released for b in s.block_table[:first])
    # a sequence holds the window's blocks and one being filled, not its whole context
    assert most <= -(-WINDOW // BLOCK) + 2 + 16 // BLOCK
    assert [s.output_ids for s in seqs] == [generate(model, p, 40, temperature=0)
                                            for p in prompts]
    assert all(r == 0 for r in eng.scheduler.blocks.ref_count)


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
