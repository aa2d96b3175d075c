"""The paged KV cache sized by a byte budget (EngineConfig.kv_cache_memory)."""

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.serve.engine import Engine, EngineConfig, kv_block_bytes
from hyla.serve.sequence import SamplingParams


def _model():
    torch.manual_seed(0)
    return HylaLM(preset("debug")).eval()       # GGGA: one attention layer


def test_budget_sets_the_blocks_and_the_bytes_held():
    model = _model()
    block = kv_block_bytes(model, 16)
    # enough for 1.5 sequences of 128 tokens (8 blocks each): 12 blocks, not 4 x 8
    cfg = EngineConfig(max_num_seqs=4, max_model_len=128, kv_cache_memory=12 * block + 5)
    engine = Engine(model, None, cfg)
    assert engine.scheduler.config.num_kv_blocks == 12
    assert engine.kv_cache_bytes == 12 * block
    held = sum(t.nbytes for layer in engine.runner.buffers for name, t in layer.items()
               if t.dim() > 1 and t.shape[1] == 16 and t.shape[0] == 13)
    assert held == 13 * block                  # the 12 blocks and the padding block
    # four requests that cannot all fit at once still all finish
    seqs = engine.generate([[1] * 100, [2] * 100, [3] * 100, [4] * 5],
                           SamplingParams(max_tokens=20, temperature=0))
    assert [len(s.output_ids) for s in seqs] == [20, 20, 20, 20]


def test_budget_past_need_is_capped_and_too_small_is_refused_with_the_minimum():
    model = _model()
    block = kv_block_bytes(model, 16)
    big = Engine(model, None, EngineConfig(max_num_seqs=2, max_model_len=64,
                                           kv_cache_memory=10**9))
    assert big.scheduler.config.num_kv_blocks == 2 * 4
    with pytest.raises(ValueError, match=f"at least {8 * block} bytes"):
        Engine(model, None, EngineConfig(max_num_seqs=2, max_model_len=128,
                                         kv_cache_memory=8 * block - 1))
