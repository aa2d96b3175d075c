"""The memory formulas, checked against real SequenceStates and the published 3B figures."""

import dataclasses

import pytest
import torch

from hyla.eval.memory import (
    kv_cache_bytes,
    memory_report,
    num_parameters,
    parse_context,
    state_bytes,
)
from hyla.model import MIXERS, HylaLM, SequenceState, preset


@pytest.mark.parametrize("n", [1, 17, 100], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("layers", ["GGGA", "AGAG", "GGGG", "AAA", "GDKA"])
def test_formula_matches_prefilled_state(layers, n):
    cfg = dataclasses.replace(preset("debug"), layers=layers)
    torch.manual_seed(0)
    model = HylaLM(cfg).eval()
    state = model.new_state()
    model.prefill(torch.randint(0, cfg.vocab_size, (n,)), state)
    want = state_bytes(cfg, n, kv_dtype=torch.float32)  # the debug model runs in fp32
    assert state.num_tokens == n
    assert state.nbytes == want["total"]
    assert state.bytes_by_kind() == {m.kind: want[m.kind] for m in MIXERS.values()}
    assert sum(want["per_layer"]) == want["total"]
    # and after decoding one more token
    model.decode(torch.tensor([1]), [state])
    assert state.nbytes == state_bytes(cfg, n + 1, kv_dtype=torch.float32)["total"]


def test_formula_matches_bf16_state():
    cfg = preset("debug")
    model = HylaLM(cfg).to(torch.bfloat16).eval()
    state = model.new_state()
    model.prefill(torch.arange(40), state)
    assert state.nbytes == state_bytes(cfg, 40)["total"]  # default kv_dtype is bf16


def test_empty_state_is_gla_only():
    cfg = preset("debug")
    assert SequenceState.empty(cfg).nbytes == state_bytes(cfg, 1)["gla"]


def test_laplace_3b_matches_published_figures():
    r = memory_report("laplace-3b", "8K", budget_gib=80)
    assert r["state_bytes"] == 24 * 16 * 96 * 192 * 4 == 28_311_552
    assert r["kv_bytes"] == 24 * 2 * 8192 * 3072 * 2
    assert abs(r["state_bytes"] - 29.5e6) / 29.5e6 < 0.05
    assert 80 < r["ratio"] < 90
    assert r["published"] == {"context": 8192, "state_bytes": 29.5e6, "ratio": 82.0}
    assert abs(r["params"] - 3.03e9) < 0.01e9
    assert r["weight_bytes"] == 2 * r["params"]
    free = 80 * 2**30 - r["weight_bytes"]
    assert r["sequences_fit"]["hybrid"] == free // r["state_bytes"]
    assert r["sequences_fit"]["attention"] == (80 * 2**30 - r["attention_weight_bytes"]) \
        // r["kv_bytes"]


def test_gla_state_is_constant_kv_grows():
    cfg = preset("laplace-3b")
    assert state_bytes(cfg, 1)["total"] == state_bytes(cfg, 1_000_000)["total"]
    assert kv_cache_bytes(cfg, 2048) == 2 * kv_cache_bytes(cfg, 1024)
    assert kv_cache_bytes(cfg, 1024, torch.float32) == 2 * kv_cache_bytes(cfg, 1024)


def test_report_without_budget_and_small_budget():
    assert memory_report("debug", 64)["sequences_fit"] is None
    tiny = memory_report("laplace-3b", 8192, budget_gib=1)  # weights alone exceed 1 GiB
    assert tiny["sequences_fit"] == {"hybrid": 0, "attention": 0}
    assert memory_report(preset("debug"), 64)["preset"] is None


def test_num_parameters_matches_a_real_model():
    cfg = preset("debug")
    assert num_parameters(cfg) == HylaLM(cfg).num_parameters()
    assert torch.nn.init.normal_(torch.zeros(3), 0.0, 1.0).abs().sum() > 0  # init restored


@pytest.mark.parametrize("text,want", [("8192", 8192), ("8K", 8192), ("8k", 8192),
                                       (" 32K ", 32768), ("1M", 2**20), (5, 5)])
def test_parse_context(text, want):
    assert parse_context(text) == want


@pytest.mark.parametrize("bad", ["", "8G", "-5", "0", "1.5K", "K", 0, -1, True])
def test_parse_context_rejects(bad):
    with pytest.raises(ValueError, match="context"):
        parse_context(bad)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown preset"):
        memory_report("nope", 8192)
    with pytest.raises(ValueError, match="budget_gib"):
        memory_report("debug", 8192, budget_gib=0)
