"""Internal routes are closed whenever a cluster secret is set (issue 30 item 3, issue 32
item 8), on loopback: every ``/internal/*`` call needs an HMAC over method, path, body and a
timestamp (a replay window), a missing or wrong one is a 401, and only the router may tell a
prefill worker where to ship states."""

import time

import pytest
import torch
from fastapi.testclient import TestClient

from hyla.disagg.live.auth import internal_http_key
from hyla.disagg.live.internal_auth import HEADER, InternalAuth, Verifier, internal_key, sign
from hyla.disagg.live.worker.prefill import PrefillService, create_prefill_app
from hyla.model import HylaLM, preset

SECRET = "loopback-cluster-secret"
ROUTER = InternalAuth(internal_key(SECRET), role="router")


@pytest.fixture(scope="module")
def prefill_client():
    torch.manual_seed(0)
    svc = PrefillService(HylaLM(preset("debug")).eval(), max_model_len=64, allowed=set())
    mp = pytest.MonkeyPatch()
    mp.setenv("HYLA_CLUSTER_SECRET", SECRET)      # as `hyla serve --role prefill` reads it
    mp.delenv("HYLA_CLUSTER_SECRET_FILE", raising=False)
    app = create_prefill_app(svc, None, internal_http_key())
    mp.undo()
    with TestClient(app) as c:
        yield c, svc
    svc.close()


def test_unsigned_internal_calls_get_401(prefill_client):
    c, svc = prefill_client
    forged = {"decode": ["tcp://10.77.0.1:9999"]}
    for method, path, body in (("POST", "/internal/registry", forged),
                               ("GET", "/internal/info", None),
                               ("POST", "/internal/prefill", {"request_id": "x"})):
        r = c.request(method, path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert "X-Hyla-Signature" in r.json()["error"]["message"]
    assert svc.sender.allowed == set()            # the forged registry changed nothing
    assert c.get("/health").status_code == 200   # public


def test_signed_by_the_router_is_accepted(prefill_client):
    c, svc = prefill_client
    r = c.post("/internal/registry", json={"decode": ["tcp://127.0.0.1:5555"]}, auth=ROUTER)
    assert r.status_code == 200 and svc.sender.allowed == {"tcp://127.0.0.1:5555"}
    assert c.get("/internal/info", auth=ROUTER).json()["registered_decode"] == 1


def test_wrong_key_role_replay_staleness_and_tampering(prefill_client):
    c, svc = prefill_client
    body = b'{"decode": ["tcp://10.77.0.1:9999"]}'
    hdr = {"content-type": "application/json"}

    def post(sig, content=body):
        return c.post("/internal/registry", content=content, headers=hdr | {HEADER: sig})
    key = internal_key(SECRET)
    assert post(sign(internal_key("other"), "POST", "/internal/registry", body)).status_code \
        == 401
    r = post(sign(key, "POST", "/internal/registry", body, role="decode"))
    assert r.status_code == 401 and "only the router" in r.json()["error"]["message"]
    r = post(sign(key, "POST", "/internal/registry", body, now=time.time() - 120))
    assert r.status_code == 401 and "stale" in r.json()["error"]["message"]
    sig = sign(key, "POST", "/internal/registry", body)
    assert post(sig, body.replace(b"9999", b"9998")).status_code == 401     # body changed
    assert post(sign(key, "GET", "/internal/registry", body)).status_code == 401  # method
    assert post(sig).status_code == 200
    r = post(sig)                                                    # replayed
    assert r.status_code == 401 and "replayed" in r.json()["error"]["message"]
    assert "malformed" in post("garbage").json()["error"]["message"]
    assert post("t=1,n=2").status_code == 401


def test_verifier_window_with_a_fake_clock():
    now = [1000.0]
    v = Verifier(internal_key("s"), window_s=30, clock=lambda: now[0])
    key = internal_key("s")
    h = sign(key, "GET", "/internal/info", b"", now=1000.0)
    assert v.check("GET", "/internal/info", b"", h) is None
    now[0] = 1100.0                      # the nonce has left the window: so has its time
    assert "stale" in v.check("GET", "/internal/info", b"", h)
    assert not v._seen or len(v._seen) == 1


def test_decode_worker_internal_routes_signed(tmp_path):
    from hyla.data.tokenizer import ByteTokenizer
    from hyla.disagg.live.worker.decode import build_decode_worker
    from hyla.serve.engine import EngineConfig

    torch.manual_seed(0)
    app, engine, rx = build_decode_worker(
        HylaLM(preset("debug")).eval(), ByteTokenizer(), "hyla-debug",
        EngineConfig(max_num_seqs=2, max_model_len=64), internal_key=internal_key(SECRET))
    try:
        with TestClient(app) as c:
            assert c.get("/internal/info").status_code == 401
            assert c.post("/internal/generate", json={}).status_code == 401
            r = c.get("/internal/info", auth=ROUTER)
            assert r.status_code == 200 and r.json()["role"] == "decode"
            assert c.get("/health").status_code == 200
    finally:
        engine.shutdown()
        rx.close()


def test_body_bound_and_unsigned_refused_before_reading():
    from fastapi import FastAPI

    from hyla.disagg.live.internal_auth import InternalAuthMiddleware

    app = FastAPI()
    seen = []

    @app.post("/internal/x")
    async def x(body: dict):
        seen.append(body)
        return {"ok": True}
    app.add_middleware(InternalAuthMiddleware, key=internal_key(SECRET), max_body=64)
    with TestClient(app) as c:
        assert c.post("/internal/x", json={"a": 1}, auth=ROUTER).json() == {"ok": True}
        r = c.post("/internal/x", json={"a": "x" * 100}, auth=ROUTER)
        assert r.status_code == 413
        assert c.post("/internal/x", json={"a": 2}).status_code == 401
    assert seen == [{"a": 1}]                    # the app saw the signed body, unchanged


@pytest.mark.parametrize("bad", [-1, 4, 1.5, "2", True, None])
def test_bad_prefix_tokens_are_a_400_naming_them(prefill_client, bad):
    """How much of the prompt the decode worker holds (its rows are not shipped) must be
    an int within the prompt."""
    c, _ = prefill_client
    c.post("/internal/registry", json={"decode": ["tcp://127.0.0.1:5555"]}, auth=ROUTER)
    r = c.post("/internal/prefill", auth=ROUTER, json={
        "request_id": "x", "prompt_ids": [1, 2, 3], "params": {"max_tokens": 1},
        "dest": "tcp://127.0.0.1:5555", "prefix_tokens": bad})
    assert r.status_code == 400 and "prefix_tokens" in r.json()["error"]["message"], r.text
