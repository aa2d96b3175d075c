"""Prometheus metrics of a serving engine (its own registry, rendered at /metrics)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hyla.serve.memory_report import group_bytes, mtp_state_bytes

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    """Queue depth, running sequences, state-pool and KV-block use, prefix-cache hit rate,
    TTFT and inter-token latency histograms, token counters, decode compilations and CUDA
    graph captures.

    Example:
        >>> m = EngineMetrics()
        >>> b"hyla_time_to_first_token_seconds" in m.render(None)
        True
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("hyla_num_requests_waiting", "Requests queued", registry=r)
        self.running = Gauge("hyla_num_requests_running", "Sequences holding a slot",
                             registry=r)
        self.pool_usage = Gauge("hyla_state_pool_usage", "Fraction of GLA-state slots used",
                                registry=r)
        self.kv_usage = Gauge("hyla_kv_block_usage", "Fraction of attention KV blocks used",
                              registry=r)
        self.state_bytes = Gauge("hyla_state_bytes", "Per-sequence state held by running "
                                 "requests, by memory group (full attention: KV blocks; "
                                 "window: rings; recurrent: fixed states; mtp: --speculative mtp's "
                                 "hidden states and MTP keys and values)", ["group"],
                                 registry=r)
        self.cache_hit = Gauge("hyla_prefix_cache_hit_rate",
                               "Prompt tokens served from the prefix cache / prompt tokens",
                               registry=r)
        self.compilations = Gauge("hyla_decode_compilations",
                                  "Decode graphs compiled (one per batch shape)", registry=r)
        self.captures = Gauge("hyla_decode_cuda_graphs",
                              "Decode CUDA graphs captured (one per batch shape)", registry=r)
        self.capture_failures = Gauge("hyla_decode_cuda_graph_failures",
                                      "Decode shapes that could not be captured (run "
                                      "uncaptured)", registry=r)
        # counters of the engine's running totals (hit rates over any window: rate() of
        # the hits over rate() of the lookups)
        self.cache_queries = Counter("hyla_prefix_cache_query_tokens",
                                     "Prompt tokens looked up in the prefix cache", registry=r)
        self.cache_hits = Counter("hyla_prefix_cache_hit_tokens",
                                  "Prompt tokens served from the prefix cache", registry=r)
        self.draft_tokens = Counter("hyla_spec_draft_tokens",
                                    "Speculative draft tokens verified", registry=r)
        self.accepted_tokens = Counter("hyla_spec_accepted_tokens",
                                       "Speculative draft tokens the model kept", registry=r)
        self._totals: dict[str, float] = {}
        self.prompt_tokens = Counter("hyla_prompt_tokens", "Prompt tokens computed",
                                     registry=r)
        self.generation_tokens = Counter("hyla_generation_tokens", "Tokens generated",
                                         registry=r)
        self.requests = Counter("hyla_requests_finished", "Finished requests", ["reason"],
                                registry=r)
        self.ttft = Histogram("hyla_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hyla_inter_token_latency_seconds", "Between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("hyla_generation_tokens_per_second",
                                  "Output tokens/s over the last scrape interval", registry=r)
        self._last_token: dict[str, float] = {}
        self._prompt_seen = 0
        self._rate_mark = (time.perf_counter(), 0)
        self._generated = 0

    def observe(self, outputs, arrival_times: dict[str, float], now: float) -> None:
        """Record one engine step's outputs (``StepOutput``s)."""
        for o in outputs:
            last = self._last_token.get(o.request_id)
            if last is None:
                arrival = arrival_times.get(o.request_id)
                if arrival is not None:
                    self.ttft.observe(now - arrival)
            else:
                self.itl.observe(now - last)
            self._last_token[o.request_id] = now
            self.generation_tokens.inc(len(o.token_ids))
            self._generated += len(o.token_ids)
            if o.finished:
                self._last_token.pop(o.request_id, None)
                self.requests.labels(o.finish_reason or "abort").inc()

    def aborted(self, request_id: str) -> None:
        """A request that ended without a final output (client gone, or cancelled)."""
        self._last_token.pop(request_id, None)
        self.requests.labels("abort").inc()

    def forget(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)

    def _catch_up(self, counter, total: float) -> None:
        """Raise ``counter`` to the engine's running ``total`` (it never goes down)."""
        seen = self._totals.get(counter._name, 0)
        if total > seen:
            counter.inc(total - seen)
            self._totals[counter._name] = total

    def render(self, engine) -> bytes:
        """The exposition text, with gauges read from ``engine`` (an Engine, or None)."""
        if engine is not None:
            s = engine.scheduler
            self.waiting.set(s.num_waiting)
            self.running.set(s.num_running)
            self.pool_usage.set(s.pool.num_used / s.pool.num_slots)
            if s.blocks is not None:
                self.kv_usage.set(s.blocks.num_used / s.blocks.num_blocks)
            for group, held in group_bytes(engine).items():
                self.state_bytes.labels(group=group).set(held["in_use"])
            if engine.runner.hidden_log is not None:
                self.state_bytes.labels(group="mtp").set(mtp_state_bytes(engine))
            if s.prefix_cache is not None:
                self.cache_hit.set(s.prefix_cache.hit_rate)
                self._catch_up(self.cache_queries, s.prefix_cache.query_tokens)
                self._catch_up(self.cache_hits, s.prefix_cache.hit_tokens)
            self._catch_up(self.draft_tokens, engine.stats["draft_tokens"])
            self._catch_up(self.accepted_tokens, engine.stats["accepted_tokens"])
            self.compilations.set(engine.runner.num_compilations)
            self.captures.set(engine.runner.num_captures)
            graphs = engine.runner.graphs
            self.capture_failures.set(graphs.capture_failures if graphs is not None else 0)
            prompt = engine.stats["prompt_tokens"]
            self.prompt_tokens.inc(max(0, prompt - self._prompt_seen))
            self._prompt_seen = max(prompt, self._prompt_seen)
        t0, n0 = self._rate_mark
        now = time.perf_counter()
        if now - t0 > 0:
            self.tokens_per_s.set((self._generated - n0) / (now - t0))
        self._rate_mark = (now, self._generated)
        return generate_latest(self.registry)
