"""Measure a simulator profile on hyla's own engine (imports torch).

:func:`measure_engine_profile` times whole :meth:`hyla.serve.engine.Engine.step` calls
(scheduling, the forward pass, sampling, prefix-cache snapshots, bookkeeping), one request
shape at a time, and returns the JSON that
:func:`hyla.disagg.sim.hardware.load_measured_profile` reads:

- ``prefill_overhead_s`` and ``prefill_tok_s``: a least-squares line through the times of
  prefill-only steps against their token counts (fixed cost + tokens / speed);
- ``decode_step_s``: the median decode-only step by batch width, every sequence at
  ``decode_context`` tokens, and ``decode_ctx_s``: the extra seconds per token of context
  beyond that (from the same widths at ``long_context``).

The engine is built as a PD worker builds it (same chunk budget and snapshot interval), so
its steps cost what the live worker's do when it has the machine to itself.
"""

from __future__ import annotations

import statistics
import time


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    if len({x for x, _ in points}) < 2:
        raise ValueError("need prefill steps of at least two different token counts")
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return intercept, slope


def measure_engine_profile(model, *, max_num_seqs: int = 16,
                           max_num_batched_tokens: int = 1024, snapshot_interval: int = 256,
                           prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024),
                           widths: tuple[int, ...] = (1, 2, 4, 8, 16), repeats: int = 7,
                           decode_steps: int = 16, short_context: int = 32,
                           long_context: int = 1024, name: str = "cpu") -> dict:
    """Step costs of ``model`` in an :class:`~hyla.serve.engine.Engine` on this machine."""
    import torch

    from hyla.serve.engine import Engine, EngineConfig
    from hyla.serve.sequence import SamplingParams

    vocab = model.cfg.vocab_size
    eng = Engine(model, None, EngineConfig(
        max_num_seqs=max(max_num_seqs, max(widths)),
        max_model_len=max(*prompt_lens, long_context) + decode_steps + 64,
        max_num_batched_tokens=max_num_batched_tokens, snapshot_interval=snapshot_interval))
    salt = iter(range(1, 1 << 30))

    def prompt(n: int) -> list[int]:
        k = next(salt)          # a new prompt every time: no prefix-cache hit
        return [(i * 7 + k * 13) % (vocab - 1) + 1 for i in range(n)]

    def timed_steps() -> list[tuple[int, int, float]]:
        """(prefill tokens, decode width, seconds) of every step until the engine idles."""
        rows = []
        while eng.has_unfinished():
            p0 = eng.stats["prompt_tokens"]
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            n_pre = eng.stats["prompt_tokens"] - p0
            # without prefill tokens, every output is one decoding sequence's token
            rows.append((n_pre, 0 if n_pre else len(outs), dt))
        return rows

    with torch.inference_mode():
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        eng.generate([prompt(32)], one)                     # first-call costs
        # Timings on a shared machine drift by tens of percent within seconds: take the
        # median step time per token count over repeats spread across the whole sweep.
        by_tokens: dict[int, list[float]] = {}
        for _ in range(repeats):
            for n in prompt_lens:
                eng.add_request(prompt(n), one)
                for p, d, t in timed_steps():
                    if p and not d:
                        by_tokens.setdefault(p, []).append(t)
        points = [(p, statistics.median(ts)) for p, ts in sorted(by_tokens.items())]
        overhead, per_token = _fit_line(points)
        params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
        contexts = (short_context, long_context)
        by_shape: dict[tuple[int, int], list[float]] = {}
        for _ in range(repeats):
            for w in widths:
                for ctx in contexts:
                    for _ in range(w):
                        eng.add_request(prompt(ctx), params)
                    by_shape.setdefault((w, ctx), []).extend(
                        t for p, d, t in timed_steps() if not p and d == w)
        step = {k: statistics.median(ts) for k, ts in by_shape.items()}
        decode = {str(w): step[w, short_context] for w in widths}
        # attention reads every cached token: the extra cost per token of context
        per_ctx = statistics.median(
            (step[w, long_context] - step[w, short_context])
            / (w * (long_context - short_context)) for w in widths)
    return {"name": name, "prefill_tok_s": 1.0 / max(per_token, 1e-12),
            "prefill_overhead_s": max(overhead, 0.0), "decode_step_s": decode,
            "decode_context": short_context, "decode_ctx_s": max(per_ctx, 0.0),
            "step_overhead_s": 0.0, "mem_gb": 8,
            "engine": {"max_num_batched_tokens": max_num_batched_tokens,
                       "snapshot_interval": snapshot_interval,
                       "threads": torch.get_num_threads()},
            "prefill_points": points}
