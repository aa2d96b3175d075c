"""Decode reads a sequence's KV blocks in place (views of consecutive blocks, no gather)
and gives what the gathering path gave; KV blocks in bfloat16; blocks handed out
consecutively; the KV reservation resident only as it fills."""

from __future__ import annotations

import pytest
import torch

from hyla.model import Context, HylaLM, preset
from hyla.ops.paged_attention import kv_spans
from hyla.serve.block_manager import BlockManager
from hyla.serve.engine import Engine, EngineConfig, kv_block_bytes, kv_dtype_for
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = preset("debug")
    cfg.layers = "GAGA"           # two attention layers (GQA: 4 query heads, 2 KV heads)
    return HylaLM(cfg).eval()


def _decode_logits(model, tables, *, in_place: bool, kv_dtype=None, steps: int = 20):
    """Prefill two prompts, then decode ``steps`` tokens of both; every step's logits."""
    r = Runner(model, max_num_seqs=2, num_kv_blocks=16, block_size=4, kv_in_place=in_place,
               kv_dtype=kv_dtype)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    r.prefill([(b, p, 0, tables[b]) for b, p in enumerate(prompts)])
    pos, out = [len(p) for p in prompts], []
    for i in range(steps):
        out.append(r.decode([0, 1], [10 + i, 20 + i], pos, tables, width=2))
        pos = [p + 1 for p in pos]
    return torch.stack(out)


def test_in_place_decode_matches_the_gather_and_reads_no_gathered_rows(model, monkeypatch):
    tables = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]    # consecutive: views
    gathered = _decode_logits(model, tables, in_place=False)
    calls = []
    monkeypatch.setattr(Context, "batch_rows", lambda self, buf: calls.append(1))
    in_place = _decode_logits(model, tables, in_place=True)
    assert not calls                        # no step gathered the cache
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)


def test_long_spans_read_by_two_gemms_give_what_sdpa_gives(model, monkeypatch):
    from hyla.ops import paged_attention as attention_module

    tables = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
    sdpa = _decode_logits(model, tables, in_place=True)
    calls = []
    real = attention_module.attend_one_query
    monkeypatch.setattr(attention_module, "LONG_SPAN_ROWS", 5)     # most steps take it
    monkeypatch.setattr(attention_module, "attend_one_query",
                        lambda *a: calls.append(1) or real(*a))
    gemms = _decode_logits(model, tables, in_place=True)
    assert calls
    torch.testing.assert_close(gemms, sdpa, rtol=1e-5, atol=1e-5)


def test_scattered_blocks_read_as_ranges_give_what_the_gather_gives(model, monkeypatch):
    scattered = [[0, 5, 2, 9, 4, 11, 6], [1, 3, 7, 8, 10, 12, 13]]
    # sequence 0 at position 7: blocks 0 (full) then 5 (its 4th row is the new one)
    assert kv_spans(scattered, [7, 3], 4) == ((5, 3, ((0, 4), (20, 4))), (1, 3, ((4, 4),)))
    descending = [[13, 12, 11, 10, 9, 8, 7], [6, 5, 4, 3, 2, 1, 0]]   # freed blocks reused
    assert kv_spans(descending, [27, 27], 4)[0] == (     # in the sequence's order
        7, 3, ((52, 4), (48, 4), (44, 4), (40, 4), (36, 4), (32, 4), (28, 4)))
    gathered = {name: _decode_logits(model, t, in_place=False)
                for name, t in (("scattered", scattered), ("descending", descending))}
    calls = []
    monkeypatch.setattr(Context, "batch_rows", lambda self, buf: calls.append(1))
    for name, t in (("scattered", scattered), ("descending", descending)):
        torch.testing.assert_close(_decode_logits(model, t, in_place=True), gathered[name],
                                   rtol=1e-5, atol=1e-5)
    assert not calls


def test_bfloat16_kv_blocks_hold_half_the_bytes_and_stay_close(model):
    tables = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
    full = _decode_logits(model, tables, in_place=True, steps=6)
    for in_place in (True, False):
        half = _decode_logits(model, tables, in_place=in_place, kv_dtype=torch.bfloat16,
                              steps=6)
        assert (half - full).norm() / full.norm() < 2e-2
    assert kv_block_bytes(model, 16, torch.bfloat16) * 2 == kv_block_bytes(model, 16)
    eng = Engine(model, None, EngineConfig(max_num_seqs=2, max_model_len=64,
                                           kv_cache_dtype="bfloat16"))
    assert eng.runner.buffers[1]["keys"].dtype == torch.bfloat16
    assert eng.kv_cache_bytes == 2 * 4 * kv_block_bytes(model, 16, torch.bfloat16)
    seqs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5, temperature=0))
    assert [len(s.output_ids) for s in seqs] == [5, 5]
    # a state taken out of a bf16 runner is in the model's dtype, as SequenceState promises
    assert eng.runner.extract(0, 3, [0]).tensors[1][0].dtype == torch.float32
    assert kv_dtype_for(model, "auto") == torch.float32     # the model's: exact outputs
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_dtype_for(model, "int8")


def test_blocks_extend_a_table_consecutively():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = bm.allocate(3)                      # 0 1 2
    b = bm.allocate(2)                      # 3 4
    bm.free(a)                              # reused last-block-first: 2 1 0 at the back
    assert bm.allocate(2, after=b[-1]) == [5, 6]
    bm.allocate(3)                          # 7 8 9
    c = bm.allocate(2)                      # the freed 2, then (after 2) nothing free: 1
    assert c == [2, 1]
    assert bm.allocate(1, after=None) == [0]


def test_engine_single_request_decodes_in_place(model, monkeypatch):
    calls = []
    real = Context.batch_rows
    monkeypatch.setattr(Context, "batch_rows",
                        lambda self, buf: calls.append(1) or real(self, buf))
    eng = Engine(model, None, EngineConfig(max_num_seqs=4, max_model_len=128, block_size=4))
    for prompt in ([1] * 9, [2] * 5, [1] * 9 + [4], [3] * 40):   # one after another, as
        eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0))   # generate does
    assert not calls


def test_kv_reservation_is_resident_only_as_it_fills(model):
    if not hasattr(torch.Tensor, "untyped_storage"):
        pytest.skip("no storage API")
    from hyla.serve.lazy_zeros import lazy_zeros

    t = lazy_zeros((64, 4, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.shape == (64, 4, 2, 8) and not t.any()


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_caches_bfloat16_under_quantised_weights_where_bf16_is_fast(monkeypatch,
                                                                          fast_bf16):
    import hyla.serve.engine as engine
    from hyla.model.quantize import quantize_model

    monkeypatch.setattr(engine, "fast_low_precision_matmul", lambda dtype, device: fast_bf16)
    q = HylaLM(preset("debug")).eval()
    quantize_model(q, "int8")
    want = torch.bfloat16 if fast_bf16 else torch.float32   # emulated bf16: the model's own
    assert kv_dtype_for(q, "auto") == want == kv_dtype_for(q, None)
    assert kv_dtype_for(q, "float32") == torch.float32          # asked for: kept
    assert kv_dtype_for(q, "bfloat16") == torch.bfloat16
