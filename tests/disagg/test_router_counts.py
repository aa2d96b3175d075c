"""The router's counters tell the truth (issue 32 item 9): ``fallback_reasons`` counts each
reason whole (it used to cut at the first colon, so a URL split it), and a stream whose
client disconnected is counted (``abandoned``)."""

import asyncio
import socket
import threading
import time

import httpx
import uvicorn

from hyla.data.tokenizer import ByteTokenizer
from hyla.disagg.live.router.app import create_router_app
from hyla.disagg.live.router.core import LiveRouter, LiveRouterConfig
from hyla.serve.engine import StepOutput


def _router() -> LiveRouter:
    return LiveRouter(LiveRouterConfig(prefill_urls=["http://127.0.0.1:9"],
                                       decode_urls=["http://127.0.0.1:9"],
                                       model_name="m", poll_s=5.0), ByteTokenizer())


def test_fallback_reasons_are_whole_phrases():
    r = _router()
    r._fallback("transfer failed", "decode worker http://127.0.0.1:4000: transfer of 'x' "
                "rejected: checksum")
    r._fallback("transfer failed", "decode worker http://127.0.0.1:4001: stalled: 1 s")
    r._fallback("remote pool saturated or down")
    assert r.fallback_reasons == {"transfer failed": 2, "remote pool saturated or down": 1}
    assert "http://127.0.0.1:4000: transfer of 'x' rejected: checksum" in r.last_errors[0]
    assert r.counts["fallback_local"] == 3


def test_a_stream_whose_client_left_is_counted():
    router = _router()

    async def slow(ids, params, rid):
        for i in range(200):
            await asyncio.sleep(0.02)
            yield StepOutput(rid, [65], "A", False, None, [], len(ids), i + 1)
    router.generate = slow
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), host="127.0.0.1",
                                           port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "router app did not start"
            time.sleep(0.05)
        body = {"model": "m", "prompt": "hi", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=10) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 10          # the client has gone: counted
        while router.counts["abandoned"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.counts["abandoned"] == 1
        view = httpx.get(f"http://127.0.0.1:{port}/cluster").json()
        assert view["counts"]["abandoned"] == 1 and view["links"] == {}
        # a path that lost a transfer: /cluster and Prometheus show it
        router.links.open("http://p", "http://d", tokens=10, probe=False).lost(1.0)
        link = httpx.get(f"http://127.0.0.1:{port}/cluster").json()["links"][
            "http://p -> http://d"]
        assert link["state"] == "degraded" and link["consecutive_failures"] == 1
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'hyla_router_link_state{prefill="http://p",decode="http://d",' \
               'state="degraded"} 1' in m
        assert 'hyla_router_link_gbps_estimate{prefill="http://p",decode="http://d"} 10' in m
    finally:
        server.should_exit = True
        t.join(10)


def test_the_kv_index_holds_what_a_worker_computed_answers_included():
    """What a decode worker holds after serving a request, as the router records it: the
    prompt once the first output arrives (the prompt's chain of 256-token chunks too), then
    the prompt and every answer token but the last (sampled, never computed) at the end, in
    the KV index's 16-token blocks."""
    from hyla.disagg.policy.prefix_index import chunk_chain

    router = _router()
    w = router.decode[0]
    ids = list(range(300))
    seen = []

    async def stream():
        for i in range(20):
            seen.append(router.kv_index.match(w.url, chunk_chain(ids + list(range(40)), 16)))
            yield StepOutput("r", [1000 + i], "x", i == 19, "length" if i == 19 else None,
                             [], len(ids), i + 1)

    async def drain():
        return [o async for o in router._served(w, ids, chunk_chain(ids, 256),
                                                chunk_chain(ids, 16), stream())]
    outs = asyncio.run(drain())
    assert len(outs) == 20 and seen[0] == 0 and seen[1] == 288    # 18 whole blocks
    answer = [1000 + i for i in range(19)]
    assert router.kv_index.match(w.url, chunk_chain(ids + answer + [5] * 40, 16)) == 304
    assert router.prefix.match(w.url, chunk_chain(ids, 256)) == 256
