"""Compiled decode: one graph a batch width serves every context length up to
``FUSED_MAX_ROWS`` and one more beyond (attention reads the paged cache in place, through
fused products, or past that through ``hyla::paged_decode_attention``), quantised layers trace
without graph breaks, and with ``eager_until_built`` a width runs eagerly until a warm-up on
another thread has built its graph (what ``hyla serve --compile`` does)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch._dynamo.utils import counters

from hyla.model import HylaLM, preset
from hyla.model.quantize import prepare_copies, quantize_model
from hyla.ops.paged_attention import SPAN_MAX_BATCH
from hyla.serve.runner import Runner

PROMPTS = [[1, 2, 3], list(range(5, 42))]      # 1 and 3 blocks of 16: tables padded to 2, 4
TABLES = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = preset("debug")
    cfg.layers = "GAGA"
    return HylaLM(cfg).eval()


def _run(runner: Runner, steps: int = 30, between=None) -> torch.Tensor:
    """Prefill both prompts, then decode ``steps`` tokens of both: every step's logits."""
    runner.prefill([(b, p, 0, TABLES[b]) for b, p in enumerate(PROMPTS)])
    pos, out = [len(p) for p in PROMPTS], []
    for i in range(steps):
        out.append(runner.decode([0, 1], [10 + i % 50, 60 + i % 50], pos, TABLES, width=2))
        pos = [p + 1 for p in pos]
        if between is not None:
            between(i)
    return torch.stack(out)


def test_one_graph_serves_every_context_length_and_matches_eager(model):
    eager = _run(Runner(model, max_num_seqs=2, num_kv_blocks=10))
    compiled = Runner(model, max_num_seqs=2, num_kv_blocks=10, compile=True)
    got = _run(compiled)         # contexts 3 .. 67 tokens: tables of 2 and 4 blocks
    assert compiled.num_compilations == 1
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_window_rings_compile_once_and_match_eager():
    """A sliding-window layer (with sinks) beside a full one: its ring is written and read
    inside the graph, one graph for every context, equal to eager past the window."""
    torch.manual_seed(1)
    cfg = preset("debug")
    cfg.layers, cfg.mixer_options = "AA", {"attention": {"sinks": True}}
    cfg.layer_overrides = [{}, {"sliding_window": 8}]
    windowed = HylaLM(cfg).eval()
    eager = _run(Runner(windowed, max_num_seqs=2, num_kv_blocks=10))
    compiled = Runner(windowed, max_num_seqs=2, num_kv_blocks=10, compile=True)
    torch.testing.assert_close(_run(compiled), eager, rtol=1e-4, atol=1e-4)
    assert compiled.num_compilations == 1


def test_a_wide_batch_compiles_once_and_matches_eager(model):
    width = SPAN_MAX_BATCH + 2                 # wide: attention through attend_fused
    tables = [list(range(5 * b, 5 * b + 5)) for b in range(width)]
    prompts = [list(range(1 + b, 4 + 3 * b)) for b in range(width)]     # 3 to 21 tokens

    def run(runner: Runner) -> torch.Tensor:
        runner.prefill([(b, p, 0, tables[b]) for b, p in enumerate(prompts)])
        pos, out = [len(p) for p in prompts], []
        for i in range(12):
            # the last few sequences join late and leave early: padding rows in between
            live = list(range(width - 3)) if 4 <= i < 8 else list(range(width))
            # each table as long as its sequence needs: the longest grows from 2 to 3 blocks
            out.append(runner.decode(live, [10 + i + b for b in live], [pos[b] for b in live],
                                     [tables[b][:pos[b] // 16 + 1] for b in live],
                                     width=width)[:width - 3])
            pos = [p + (b in live) for b, p in enumerate(pos)]
        return torch.stack(out)

    eager = run(Runner(model, max_num_seqs=width, num_kv_blocks=5 * width))
    compiled = Runner(model, max_num_seqs=width, num_kv_blocks=5 * width, compile=True)
    got = run(compiled)
    assert compiled.num_compilations == 1
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_quantised_layers_compile_without_graph_breaks(model):
    q = copy.deepcopy(model)
    quantize_model(q, "int4")
    prepare_copies(q)          # the int8 and bf16 copies exist before the graph reads them
    eager = _run(Runner(q, max_num_seqs=2, num_kv_blocks=10), steps=6)
    counters.clear()
    compiled = Runner(q, max_num_seqs=2, num_kv_blocks=10, compile=True)
    got = _run(compiled, steps=6)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled.num_compilations == 1
    # the graph keeps some bf16 roundings in float32, so not bit for bit
    torch.testing.assert_close(got, eager, rtol=0.02, atol=0.02)


def test_compiled_runners_make_the_quantised_copies_before_tracing(model):
    """No prepare_copies by the caller, two compiled runners on one model: each graph names
    fbgemm weights that still exist (a copy first made inside a trace was dropped after it,
    and the second runner's graph failed with a KeyError)."""
    q = copy.deepcopy(model)
    quantize_model(q, "int4-a8")
    got = [_run(Runner(q, max_num_seqs=2, num_kv_blocks=10, compile=True), steps=3)
           for _ in range(2)]        # compiled first: no eager call made the copies
    eager = _run(Runner(q, max_num_seqs=2, num_kv_blocks=10), steps=3)
    for g in got:
        torch.testing.assert_close(g, eager, rtol=0.05, atol=0.05)


def test_a_width_runs_eagerly_until_a_background_warm_up_builds_it(model):
    want = _run(Runner(model, max_num_seqs=2, num_kv_blocks=10))
    runner = Runner(model, max_num_seqs=2, num_kv_blocks=10, compile=True,
                    eager_until_built=True)
    warm = threading.Thread(target=runner.warmup, args=((2,), 5))
    graphed = []

    def around_the_warm_up(i: int) -> None:
        graphed.append(runner.runs_graph(2))
        if i == 0:
            warm.start()                # compiles while this thread goes on decoding
        if i == 19:
            warm.join()                 # the last ten steps run the graph
    got = _run(runner, between=around_the_warm_up)
    assert graphed[0] is False and graphed[-1] is True
    assert runner.num_compilations >= 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tables_past_fused_max_rows_take_the_op_in_a_graph_of_their_own(model, monkeypatch):
    import hyla.ops.paged_attention as paged
    import hyla.serve.runner as runner_module

    # 48 rows instead of 2,048: the tables grow from 2 to 5 blocks of 16 across the cut
    monkeypatch.setattr(paged, "FUSED_MAX_ROWS", 48)
    monkeypatch.setattr(runner_module, "FUSED_MAX_ROWS", 48)
    eager = _run(Runner(model, max_num_seqs=2, num_kv_blocks=10))
    compiled = Runner(model, max_num_seqs=2, num_kv_blocks=10, compile=True)
    assert compiled.warmup((2,), 5) == 2              # a graph each side of the cut
    got = _run(compiled)
    assert compiled.num_compilations == 2             # and none more while serving
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    assert Runner(model, max_num_seqs=2, num_kv_blocks=10, compile=True).warmup((2,), 3) == 1
