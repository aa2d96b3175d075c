"""CUDA graphs for the decode step: one captured graph per fixed decode shape.

The runner pads decode batches to a fixed set of widths and block-table lengths, so the set
of decode shapes is closed; each shape is captured once (``torch.cuda.CUDAGraph``, all graphs
in one memory pool) and every later step of that shape is a copy of its inputs into the
graph's static input tensors and one replay: no per-kernel launch cost, which dominates a
small model's decode. The state and KV buffers the model updates are the runner's own,
allocated once, so their addresses are what the graphs recorded.

A graph's warm-up and capture run the step on *padding* inputs (the runner's pad slot and
pad block, token 0), never on a real batch: capturing on demand in the middle of serving does
not advance anyone's state twice. Capture is explicit rather than through
``torch.compile(mode="reduce-overhead")`` so that the number of graphs is exact (it is in
``/metrics``) and a shape that cannot be captured falls back to the uncaptured step, counted
and logged, instead of being skipped silently. The capture function is a parameter: on a CPU
the tests drive all of this with a stand-in that records and re-runs the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# (step, static inputs, pool) -> (replay, static output)
Capture = Callable[[Callable, tuple, object], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(fn: Callable, inputs: tuple, pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm ``fn(*inputs)`` up on a side stream (compilation, autotuning and first
    allocations happen there), then record one call into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*inputs)
    return graph.replay, out


@dataclass
class _Graph:
    inputs: tuple[torch.Tensor, ...]
    replay: Callable[[], None] | None      # None: this shape could not be captured
    output: torch.Tensor | None


class DecodeGraphs:
    """Captured decode steps by input shapes.

    ``graphs(pad_inputs, inputs)`` returns ``fn(*inputs)`` computed by replaying the graph of
    these shapes, capturing it first (on ``pad_inputs``, same shapes) if needed. The result
    is a fresh tensor (the graph's output buffer is reused by the next replay).

    Example (a stand-in capture on the CPU: it re-runs the step on the static inputs):
        >>> def rerun(fn, inputs, pool):
        ...     out = fn(*inputs)
        ...     return (lambda: out.copy_(fn(*inputs))), out
        >>> g = DecodeGraphs(lambda x: x * 2, capture=rerun)
        >>> g((torch.zeros(3),), (torch.ones(3),)).tolist(), g.num_captures
        ([2.0, 2.0, 2.0], 1)
        >>> g((torch.zeros(3),), (torch.arange(3.0),)).tolist(), g.num_captures
        ([0.0, 2.0, 4.0], 1)
    """

    def __init__(self, fn: Callable, *, capture: Capture | None = None):
        self.fn = fn
        self.capture = capture or cuda_capture
        self.pool = None
        self.graphs: dict[tuple, _Graph] = {}
        self.num_captures = 0
        self.capture_failures = 0
        self.capture_time_s = 0.0

    def __call__(self, pad_inputs: tuple[torch.Tensor, ...],
                 inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key, pad_inputs)
        if g.replay is None:
            return self.fn(*inputs)
        for static, x in zip(g.inputs, inputs, strict=True):
            static.copy_(x)
        g.replay()
        return g.output.clone()

    def _capture(self, key, pad_inputs) -> _Graph:
        statics = tuple(x.clone() for x in pad_inputs)
        if self.pool is None and self.capture is cuda_capture:
            self.pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        try:
            replay, out = self.capture(self.fn, statics, self.pool)
        except Exception as e:  # noqa: BLE001 - any capture error: serve this shape uncaptured
            self.capture_failures += 1
            log.warning("decode shape %s not captured as a CUDA graph (%s: %s); it runs "
                        "uncaptured", [k[0] for k in key], type(e).__name__, e)
            return _Graph(statics, None, None)
        finally:
            self.capture_time_s += time.perf_counter() - t0
        self.num_captures += 1
        return _Graph(statics, replay, out)
