"""Fair scheduling across requests (issue 32, item 7): the prompts of a batch request are
served as one request beside the others, so a small request next to a huge batch finishes
within a small multiple of its own time (in engine steps here: no timing noise)."""

import asyncio

import pytest
import torch
from fastapi.testclient import TestClient

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.serve.api.app import create_app
from hyla.serve.async_engine import AsyncEngine
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.scheduler import Scheduler, SchedulerConfig
from hyla.serve.sequence import SamplingParams, Sequence


def _steps_until(s: Scheduler, target: Sequence, limit: int = 10_000) -> int:
    """Run the scheduler (every computed last token samples token 1) until ``target``
    finishes; returns the steps taken."""
    for step in range(1, limit):
        out = s.schedule()
        sampled = {q.request_id: 1 for q in out.decodes}
        sampled |= {c.seq.request_id: 1 for c in out.prefills if c.samples}
        s.update(out, sampled)
        if target.is_finished:
            return step
    raise AssertionError("never finished")


def _small() -> Sequence:
    return Sequence("small", [7] * 5, SamplingParams(max_tokens=5))


@pytest.mark.parametrize("kv", [0, 512], ids=["no-kv", "kv"])
def test_a_small_request_is_not_starved_by_a_batch(kv):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                          num_kv_blocks=kv, enable_prefix_caching=False)
    alone = Scheduler(cfg)
    small = _small()
    alone.add(small)
    own = _steps_until(alone, small)

    s = Scheduler(cfg)
    batch = [Sequence(f"b-{i}", [i % 200 + 1] * 40, SamplingParams(max_tokens=16),
                      group="b") for i in range(256)]
    for q in batch:
        s.add(q)
    while s.pool.num_free:               # until the batch holds every slot
        out = s.schedule()
        sampled = {q.request_id: 1 for q in out.decodes}
        s.update(out, sampled | {c.seq.request_id: 1 for c in out.prefills if c.samples})
    small = _small()
    s.add(small)
    waited = _steps_until(s, small)
    # First come, first served over prompts, it would wait for all 256 prompts (about
    # 256 * 40 / 64 = 160 steps of prefill alone, 256 * 16 / 8 = 512 of decode).
    assert waited <= 3 * own + 2, (waited, own)
    assert sum(q.is_finished for q in batch) <= cfg.max_num_seqs
    while s.has_unfinished():            # and the batch still completes, nothing leaked
        _steps_until(s, batch[-1]) if not batch[-1].is_finished else s.update(
            s.schedule(), {})
    assert all(q.finish_reason == "length" for q in batch)
    assert s.pool.num_free == cfg.max_num_seqs


def test_independent_requests_stay_first_come_first_served():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8))
    seqs = [Sequence(f"r{i}", [1] * 20, SamplingParams(max_tokens=1)) for i in range(3)]
    for q in seqs:
        s.add(q)
    finished = []
    while s.has_unfinished():
        out = s.schedule()
        finished += [q.request_id for q in s.update(
            out, {c.seq.request_id: 1 for c in out.prefills if c.samples})]
    assert finished == ["r0", "r1", "r2"] and s.num_preemptions == 0


def test_api_batch_beside_a_small_request():
    """Through the API: a 64-prompt batch request and, once it runs, a 4-token request;
    the small one finishes while most of the batch is still to come."""
    torch.manual_seed(0)
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=4, max_model_len=256,
                                          max_num_batched_tokens=64)))
    client = TestClient(create_app(eng, model_name="m"))
    done: list[str] = []
    real = eng.engine.step

    def step():
        outs = real()
        done.extend(o.request_id for o in outs if o.finished)
        return outs
    eng.engine.step = step

    async def both():
        loop = asyncio.get_running_loop()
        batch = loop.run_in_executor(None, lambda: client.post("/v1/completions", json={
            "prompt": ["x" * 150] * 64, "max_tokens": 4, "temperature": 0}))
        for _ in range(6000):           # until the batch holds every slot (60 s at most)
            if eng.engine.scheduler.num_running == 4 or batch.done():
                break
            await asyncio.sleep(0.01)
        small = await loop.run_in_executor(None, lambda: client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}))
        return small, await batch
    try:
        small, batch = asyncio.run(both())
    finally:
        eng.shutdown()
    assert small.status_code == 200 and batch.status_code == 200
    assert len(batch.json()["choices"]) == 64
    first_small = next(i for i, rid in enumerate(done) if rid.startswith("cmpl-")
                       and not rid.rsplit("-", 1)[1].isdigit())
    assert first_small <= 8, done[:first_small + 1]   # after at most 8 of the 64 prompts
