"""Start-up: while the engine warms up in the background ``/health`` answers 503
``{"status": "starting"}`` and generation requests wait; then 200 and they run. The warm-up
(``hyla serve``'s) sets ready, leaves no trace in the metrics, and ends the server when it
fails."""

from __future__ import annotations

import argparse
import asyncio
import threading

import httpx
import pytest
import torch
from rich.console import Console

from hyla.cli.serve import warm_up
from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.serve.api.app import create_app
from hyla.serve.async_engine import AsyncEngine
from hyla.serve.engine import Engine, EngineConfig


@pytest.fixture()
def engine():
    torch.manual_seed(0)
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=2, max_model_len=64)))
    yield eng
    eng.shutdown()


def test_health_says_starting_and_requests_wait_until_ready(engine):
    ready = threading.Event()
    app = create_app(engine, model_name="m", ready=ready)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "starting"
            assert (await c.get("/v1/models")).status_code == 200   # the rest answers
            body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
            pending = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            assert not pending.done()               # held until the warm-up is over
            ready.set()
            r = await asyncio.wait_for(pending, 30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"

    asyncio.run(scenario())


def test_dead_engine_wins_over_starting(engine):
    app = create_app(engine, model_name="m", ready=threading.Event())
    engine.error = RuntimeError("boom")
    try:
        async def health():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await c.get("/health")
        h = asyncio.run(health())
    finally:
        engine.error = None
    assert h.status_code == 503 and h.json()["status"] == "error"


def test_warm_up_sets_ready_and_leaves_no_request_in_the_metrics(engine):
    ready, failed = threading.Event(), []
    args = argparse.Namespace(compile=False, cuda_graphs=False)
    warm_up(engine, args, Console(quiet=True), ready, failed.append)
    assert ready.is_set() and not failed
    assert engine.engine.stats["steps"] >= 1                # the tiny request ran
    text = engine.metrics.render(engine.engine).decode()
    count = [ln for ln in text.splitlines()
             if ln.startswith("hyla_time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) == 0


def _warm_up_failing(engine, monkeypatch, message: str, **flags):
    """Run the server's warm-up with ``engine.warmup`` raising ``message``: (ready, the
    failures handed on, what it printed)."""
    ready, failed = threading.Event(), []

    def broken(*a, **k):
        raise RuntimeError(message)
    monkeypatch.setattr(engine.engine, "warmup", broken)
    console = Console(record=True, width=200)
    warm_up(engine, argparse.Namespace(**flags), console, ready, failed.append)
    return ready, failed, console.export_text()


def test_failed_warm_up_ends_the_server_and_never_says_ready(engine, monkeypatch):
    ready, failed, _ = _warm_up_failing(engine, monkeypatch, "no kernels", compile=False,
                                        cuda_graphs=True)      # captured before ready
    assert not ready.is_set() and "no kernels" in repr(failed[0])


def test_compiling_fails_after_ready_and_the_server_stays_eager(engine, monkeypatch):
    ready, failed, printed = _warm_up_failing(engine, monkeypatch, "no compiler", compile=True,
                                              cuda_graphs=False)   # built after ready
    assert ready.is_set() and not failed
    assert "no compiler" in printed


def test_health_says_which_mode_serves_and_why_compiling_fell_back():
    """``/health``'s ``decode_mode``: eager without ``--compile``; with it, ``compiling``
    while the background warm-up builds the widths; a warm-up that fails leaves the server
    serving eagerly, ``eager-fallback`` with the reason (a warning in the log)."""
    torch.manual_seed(0)
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=2, max_model_len=64, compile=True,
                                          eager_until_compiled=True)))

    async def health(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            return (await c.get("/health")).json()
    try:
        ready, failed = threading.Event(), []
        app = create_app(eng, model_name="m", ready=ready)

        def broken(*_a, **_k):
            raise RuntimeError("no C compiler here")
        eng.engine.warmup = broken
        assert eng.engine.runner.decode_mode((1, 2)) == "compiling"
        log = Console(record=True, width=200)
        warm_up(eng, argparse.Namespace(compile=True, cuda_graphs=False), log, ready,
                failed.append)
        assert ready.is_set() and not failed
        assert "compiling decode failed" in log.export_text()
        h = asyncio.run(health(app))
        assert h["decode_mode"] == "eager-fallback" and "no C compiler" in h["compile_error"]
    finally:
        eng.shutdown()
    plain = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                               EngineConfig(max_num_seqs=2, max_model_len=64)))
    try:
        assert asyncio.run(health(create_app(plain, model_name="m")))["decode_mode"] == "eager"
    finally:
        plain.shutdown()


def test_the_warm_up_logs_where_the_memory_goes(engine):
    from hyla.serve.memory_report import breakdown, rss_bytes

    log = Console(record=True, width=300)
    warm_up(engine, argparse.Namespace(compile=False, cuda_graphs=False), log,
            threading.Event(), [].append, rss_before_model=rss_bytes())
    line = log.export_text()
    assert "MB resident = weights" in line and "before the model was loaded" in line
    parts = breakdown(engine.engine)
    params = sum(p.numel() * p.element_size() for p in engine.engine.model.parameters())
    assert parts["weights_float"] >= params and parts["weights_quantised"] == 0
    assert parts["state_slots"] > 0 and parts["resident"] >= sum(
        parts[k] for k in ("weights_float", "state_slots", "kv_in_use"))
    assert parts["kv_in_use"] == 0 < parts["kv_reserved"]      # nothing running now


def test_quantised_weights_count_as_quantised_and_each_storage_once():
    from hyla.model.quantize import quantize_model
    from hyla.serve.memory_report import tensor_bytes

    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    before = tensor_bytes(model)
    quantize_model(model, "int8")
    after = tensor_bytes(model)
    assert after["quantised"] > 0 and after["float"] + after["quantised"] < before["float"]
    model.tied = model.norm.weight          # a second name for one storage adds nothing
    assert tensor_bytes(model) == after


def test_fbgemm_packed_copies_count_as_quantised_weights():
    """fbgemm's packed int8 copies are not torch tensors: the breakdown once left them in
    "the rest" (SmolLM2 int4-a8: about 160 MB of weights uncounted)."""
    from hyla.model.quantize import prepare_copies, quantize_model
    from hyla.model.vnni_int8 import int8_products_available
    from hyla.serve.memory_report import tensor_bytes

    if not int8_products_available():
        pytest.skip("fbgemm's int8 products need an x86 CPU with AVX2")
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    quantize_model(model, "int4-a8")
    before = tensor_bytes(model)["quantised"]
    prepare_copies(model)
    head = model.lm_head.vnni_matmul()
    grown = tensor_bytes(model)["quantised"] - before
    assert grown >= head.packed_bytes >= model.lm_head.out_features * model.lm_head.in_features
    assert tensor_bytes(model)["quantised"] - before == grown     # each copy once


def test_the_warm_up_logs_where_the_start_up_time_went(engine):
    from hyla.serve.startup import StartupClock, process_age_s

    age = process_age_s()
    assert age is not None and age > 0      # this process started before the test ran
    clock = StartupClock()
    assert clock.phases[0][0] == "Python and imports" and clock.phases[0][1] >= age
    clock.mark("loading")
    log = Console(record=True, width=300)
    warm_up(engine, argparse.Namespace(compile=False, cuda_graphs=False), log,
            threading.Event(), [].append, clock=clock)
    line = next(x for x in log.export_text().splitlines() if x.startswith("ready in "))
    assert [p for p, _ in clock.phases] == ["Python and imports", "loading", "warm-up"]
    total = float(line.split()[2])
    assert abs(total - sum(s for _, s in clock.phases)) < 0.06 and "warm-up" in line
