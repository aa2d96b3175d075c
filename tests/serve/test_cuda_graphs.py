"""CUDA-graph decode, as far as a CPU can check it: the runner's graph bookkeeping (static
inputs, capture on padding only, one capture per shape, fallback when a capture fails, the
counts in /metrics) driven by a stand-in capture that re-runs the step on the static inputs
the way a replay would. The real capture (torch.cuda.CUDAGraph) runs in
benchmarks/gpu_check.sh on a GPU."""

from __future__ import annotations

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.serve.cuda_graphs import DecodeGraphs
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.metrics import EngineMetrics
from hyla.serve.runner import Runner
from hyla.serve.sequence import SamplingParams


def rerun_capture(log):
    """A replay = the step run again on the static inputs (whatever they hold now)."""
    def capture(fn, inputs, pool):
        log.append(tuple(x.clone() for x in inputs))
        out = fn(*inputs)
        return (lambda: out.copy_(fn(*inputs))), out
    return capture


def failing_capture(fn, inputs, pool):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HylaLM(preset("debug")).eval()        # GGGA: GLA states and paged KV


def _run(runner, steps):
    """Prefill three sequences, then decode them in batches of changing widths."""
    out = [runner.prefill([(s, [1 + s, 2, 3, 4 + s], 0, [s]) for s in range(3)])]
    pos = 4
    for slots in steps:
        out.append(runner.decode(slots, [5 + s for s in slots], [pos] * len(slots),
                                 [[s] for s in slots], width=4 if len(slots) > 2 else 2))
        pos += 1
    return out


def test_graphed_decode_equals_eager(model):
    steps = [[0, 1, 2], [0, 1], [0, 1, 2], [2]]
    eager = Runner(model, max_num_seqs=4, num_kv_blocks=8)
    log = []
    graphed = Runner(model, max_num_seqs=4, num_kv_blocks=8, cuda_graphs=True,
                     capture=rerun_capture(log))
    want, got = _run(eager, steps), _run(graphed, steps)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for la, lb in zip(eager.buffers, graphed.buffers, strict=True):
        for name in la:
            torch.testing.assert_close(la[name][:4], lb[name][:4], rtol=1e-5, atol=1e-5)
    # shapes (width, table length): (4, 1) and (2, 1): captured once each, on padding only
    assert graphed.num_captures == 2 and len(log) == 2
    for tokens, slots, positions, tables in log:
        assert (slots == graphed.pad_slot).all() and (tables == graphed.pad_block).all()
        assert not tokens.any() and not positions.any()


def test_capture_touches_only_padding(model):
    r = Runner(model, max_num_seqs=3, num_kv_blocks=4, cuda_graphs=True,
               capture=rerun_capture([]))
    r.warmup((1, 2, 4), max_blocks=4)
    assert r.num_captures == 3 * 3                  # widths x table lengths 1, 2, 4
    for layer in r.buffers:
        for name, buf in layer.items():
            pad = r.pad_block if buf.shape[0] == r.pad_block + 1 else r.pad_slot
            assert not buf[:pad].any(), name          # real slots and blocks untouched


def test_failed_capture_runs_uncaptured_and_is_counted(model):
    eager = Runner(model, max_num_seqs=4, num_kv_blocks=8)
    r = Runner(model, max_num_seqs=4, num_kv_blocks=8, cuda_graphs=True,
               capture=failing_capture)
    for a, b in zip(_run(eager, [[0, 1, 2]]), _run(r, [[0, 1, 2]]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert r.num_captures == 0 and r.graphs.capture_failures == 1


def test_cuda_graphs_need_cuda(model):
    with pytest.raises(ValueError, match="CUDA"):
        Runner(model, max_num_seqs=2, num_kv_blocks=4, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA"):
        Engine(model, None, EngineConfig(max_num_seqs=2, max_model_len=64, cuda_graphs=True))


def test_engine_warmup_captures_and_metrics_count(model):
    """An engine whose runner replays graphs generates what an eager one does, captures
    every shape in warm-up and none while serving, and /metrics says how many."""
    cfg = dict(max_num_seqs=4, max_model_len=64, decode_widths=(1, 2, 4))
    eager = Engine(model, None, EngineConfig(**cfg))
    eng = Engine(model, None, EngineConfig(**cfg))
    eng.runner.graphs = DecodeGraphs(eng.runner._decode_fn, capture=rerun_capture([]))
    captured = eng.warmup()
    assert captured == 0 and eng.runner.num_captures == 3 * 3   # 64 tokens: 4 blocks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4] * 20]
    want = [s.output_ids for s in eager.generate(prompts, params)]
    got = [s.output_ids for s in eng.generate(prompts, params)]
    assert got == want
    assert eng.runner.num_captures == 9
    text = EngineMetrics().render(eng).decode()
    assert "hyla_decode_cuda_graphs 9.0" in text
    assert "hyla_decode_cuda_graph_failures 0.0" in text
