"""Reliability, third round (issue 32): poisoned weights, unsupported OpenAI fields, idle
and half-sent connections, request-smuggling headers, fair scheduling across requests."""

import json
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from hyla.cli.main import main
from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import WEIGHTS, save_checkpoint
from hyla.model.load import load_model
from hyla.serve.api.app import create_app
from hyla.serve.async_engine import AsyncEngine
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.http_guard import ServerLimits, server_config


def _events(text: str) -> list[dict]:
    """Every SSE event of a stream, parsed strictly (json.loads accepts NaN; this does not)."""
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")
    return [json.loads(e[6:], parse_constant=no_constants) for e in text.split("\n\n")
            if e.startswith("data: {")]


def _strict(body: str):
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(body, parse_constant=no_constants)


# -- 3. a checkpoint with a NaN weight ---------------------------------------------------
@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    d = tmp_path_factory.mktemp("nan")
    torch.manual_seed(0)
    save_checkpoint(HylaLM(preset("debug")), d)
    weights = load_file(str(d / WEIGHTS))
    weights["lm_head.weight"][3, 5] = float("nan")
    save_file(weights, str(d / WEIGHTS), metadata={"format": "pt"})
    return d


def test_nonfinite_weights_are_refused_by_name(poisoned, capsys):
    with pytest.raises(ValueError, match=r"lm_head\.weight \(1 NaN, 0 inf\).*--allow-nonfinite"):
        load_model(poisoned)
    model, _ = load_model(poisoned, allow_nonfinite=True)       # forensics
    assert torch.isnan(model.lm_head.weight).sum() == 1
    assert main(["generate", "--checkpoint", str(poisoned), "--prompt", "a",
                 "--max-tokens", "2"]) == 2
    assert "lm_head.weight" in capsys.readouterr().err


def test_the_api_never_emits_nan(poisoned):
    model, tok = load_model(poisoned, allow_nonfinite=True)
    eng = AsyncEngine(Engine(model, tok, EngineConfig(max_num_seqs=4, max_model_len=64)))
    try:
        client = TestClient(create_app(eng, model_name="m"))
        for body, path in (({"prompt": "ab", "max_tokens": 3, "logprobs": 2}, "/v1/completions"),
                           ({"messages": [{"role": "user", "content": "ab"}], "max_tokens": 3,
                             "logprobs": True, "top_logprobs": 2}, "/v1/chat/completions")):
            for temperature in (0, 1.0):
                r = client.post(path, json=body | {"temperature": temperature})
                assert r.status_code in (200, 503), r.text
                _strict(r.text)
                s = client.post(path, json=body | {"temperature": temperature,
                                                   "stream": True})
                assert s.status_code in (200, 503)
                if s.status_code == 200:
                    assert _events(s.text) or "error" in s.text
                else:
                    _strict(s.text)
        greedy = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3,
                                                      "logprobs": 1, "temperature": 0})
        if greedy.status_code == 200:
            lps = greedy.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert all(v is None or v == v for v in lps)
    finally:
        eng.shutdown()


# -- 5. unsupported OpenAI features, 9. the stop-limit's param ------------------------
@pytest.fixture(scope="module")
def client():
    torch.manual_seed(0)
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=4, max_model_len=128)))
    yield TestClient(create_app(eng, model_name="m"))
    eng.shutdown()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra,param,paths", [
    ({"tools": [TOOL], "tool_choice": "required"}, "tools", ("/v1/completions",)),
    ({"tools": [TOOL]}, "tools", ("/v1/completions",)),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     ("/v1/chat/completions", "/v1/completions")),
    ({"functions": [TOOL["function"]]}, "functions",
     ("/v1/chat/completions", "/v1/completions")),
    ({"function_call": "auto"}, "function_call", ("/v1/chat/completions", "/v1/completions")),
], ids=["tools-required", "tools", "tool_choice", "functions", "function_call"])
def test_unimplemented_features_are_400_naming_the_field(client, extra, param, paths):
    """What hyla does not serve: tools on completions (chat has them), a tool_choice with
    no tools, the legacy functions."""
    bodies = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "x",
                                                                 "max_tokens": 2}}
    for path in paths:
        r = client.post(path, json=bodies[path] | extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
    {"functions": None}, {"function_call": "none"}, {"response_format": None}])
def test_neutral_values_are_accepted(client, extra):
    assert client.post("/v1/chat/completions", json=CHAT | extra).status_code == 200


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"] * 10}, "stop"),
    ({"stop": "x" * 10_000}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": list(range(10_000))}, "stop_token_ids"),
])
def test_every_sampling_400_names_its_param(client, extra, param):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2} | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- 6. header, body and idle deadlines; the connection cap; 9. CL + TE ----------------
LIMITS = ServerLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0,
                      max_connections=4)


@pytest.fixture(scope="module")
def live():
    """A real uvicorn server (the one ``hyla serve`` builds) in a thread, 1 s deadlines."""
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=4, max_model_len=128)))
    app = create_app(eng, model_name="m", body_timeout=LIMITS.body_timeout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, LIMITS, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)
    eng.shutdown()


def _closed_within(sock: socket.socket, seconds: float) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it sent before)."""
    start, got = time.monotonic(), b""
    sock.settimeout(seconds)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - start, got
        got += chunk


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _healthy(port: int) -> None:
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert r.status_code == 200, r.text


def test_a_silent_connection_is_closed(live):
    with _connect(live) as s:
        took, got = _closed_within(s, 10)
    assert took < 3 and got == b""
    _healthy(live)


def test_trickled_headers_are_cut_off(live):
    with _connect(live) as s:
        start = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(50):         # slowloris: a byte every 0.2 s, headers never finished
            try:
                s.sendall(b"X")
                time.sleep(0.2)
                closed = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:         # nothing to read: still open
                continue
            except OSError:                 # reset: closed
                closed = True
            if closed:
                break
        assert closed and 0.9 < time.monotonic() - start < 4
    _healthy(live)


def test_a_half_sent_body_is_408_and_closed(live):
    with _connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        took, got = _closed_within(s, 10)
    assert took < 4 and got.startswith(b"HTTP/1.1 408"), got[:200]
    _strict(got.split(b"\r\n\r\n", 1)[1].decode())
    _healthy(live)


def test_an_idle_keep_alive_connection_is_closed(live):
    with _connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        took, got = _closed_within(s, 10)
    assert got.startswith(b"HTTP/1.1 200") and took < 3


def test_content_length_with_transfer_encoding_is_refused(live):
    with _connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        took, got = _closed_within(s, 10)
    assert got.startswith(b"HTTP/1.1 400") and got.count(b"HTTP/1.1") == 1, got
    assert _strict(got.split(b"\r\n\r\n", 1)[1].decode())["error"]["param"] == \
        "Transfer-Encoding"


def test_connections_past_the_cap_are_refused(live):
    held = [_connect(live) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)
        with _connect(live) as extra:
            took, got = _closed_within(extra, 10)
        assert got.startswith(b"HTTP/1.1 503") and took < 1
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    _healthy(live)
