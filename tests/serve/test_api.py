"""The OpenAI-compatible server as users run it: a real ``python -m hyla serve`` subprocess
(debug preset: random weights, byte tokenizer), driven by the official ``openai`` client,
with httpx for what that client will not send (malformed JSON, wrong types)."""

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

MODEL = "hyla-debug"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: pathlib.Path, *extra: str, env_extra: dict | None = None):
    port = _free_port()
    log = open(tmp / "server.log", "w+b")  # noqa: SIM115 - closed at teardown
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyla", "serve", "--preset", "debug", "--port", str(port),
         "--threads", "1", "--log-level", "warning", *extra],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited ({proc.returncode}):\n{log.read().decode()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not come up in 90 s")
        time.sleep(0.2)
    return base, proc, log


def _stop(proc, log):
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, proc, log = _start(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "16",
                             "--max-model-len", "512")
    yield base
    _stop(proc, log)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """One running sequence, one waiting, an API key."""
    base, proc, log = _start(tmp_path_factory.mktemp("limited"), "--max-num-seqs", "1",
                             "--max-waiting", "1", "--max-model-len", "8192",
                             env_extra={"HYLA_API_KEY": "sekrit"})
    yield base
    _stop(proc, log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


def _wait_idle(base: str, headers=None, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{base}/health", headers=headers).json()
        idle = {k: h[k] for k in ("running", "waiting", "state_slots_used", "kv_blocks_used")}
        if not any(idle.values()) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(f"{server}/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.finish_reason == "length" and isinstance(c.text, str)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 6, 11)
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    assert again.choices[0].text == c.text                    # greedy is deterministic


def test_completion_token_ids_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=3, logprobs=2,
                                  seed=1)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == 2 and len(lp.tokens) == 3
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    want = len("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")
    assert r.usage.prompt_tokens == want and r.usage.completion_tokens <= 5


def test_stream_completion_matches_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_chat(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert "usage" not in last and last["choices"][0]["finish_reason"] == "length"


def test_64_concurrent_requests(server, client):
    prompts = [f"prompt {i}" for i in range(8)]
    want = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
            .choices[0].text for p in prompts]

    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0,
                                timeout=60)
        try:
            return await asyncio.gather(*[
                ac.completions.create(model=MODEL, prompt=prompts[i % 8], max_tokens=6,
                                      temperature=0) for i in range(64)])
        finally:
            await ac.close()

    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 6 for r in results)
    assert [r.choices[0].text for r in results] == [want[i % 8] for i in range(64)]
    assert _wait_idle(server)["running"] == 0


@pytest.mark.parametrize("path,body,param", [
    ("completions", b'{"model": "hyla-debug", "prompt": ', None),
    ("completions", b'[1, 2]', None),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": "x" * 600}, "prompt"),
    ("completions", {"prompt": [1, 256]}, "prompt"),
    ("completions", {"prompt": ["a", "b"], "stream": True}, "stream"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9999},
     "max_tokens"),
], ids=["json", "not-object", "type", "prompt-type", "model", "empty", "empty-ids", "too-long",
        "bad-id", "batch", "max0", "max-neg", "max-ctx", "temp", "top_p", "n", "stream-type",
        "no-messages", "messages-type", "role", "no-role", "chat-ctx"])
def test_bad_requests_are_400(server, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}/v1/{path}", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and "code" in err


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.status_code == 400
    assert httpx.get(f"{client.base_url}models").status_code == 200     # still up


def test_client_disconnect_frees_the_slot(server):
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 480,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        lines = r.iter_lines()            # kept: a dropped iterator closes the connection
        next(line for line in lines if line.startswith("data: "))
        h = httpx.get(f"{server}/health").json()
        assert h["running"] == 1 and h["state_slots_used"] == 1 and h["kv_blocks_used"] > 0
    h = _wait_idle(server)        # the stream was closed long before 480 tokens
    assert (h["running"], h["waiting"], h["state_slots_used"], h["kv_blocks_used"]) == (0,) * 4
    assert client_ok(server)


def client_ok(base: str) -> bool:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    return r.status_code == 200


def test_metrics(server):
    text = httpx.get(f"{server}/metrics").text
    for name in ("hyla_num_requests_waiting", "hyla_num_requests_running",
                 "hyla_state_pool_usage", "hyla_kv_block_usage", "hyla_prefix_cache_hit_rate",
                 "hyla_time_to_first_token_seconds_bucket",
                 "hyla_inter_token_latency_seconds_bucket", "hyla_generation_tokens_total",
                 "hyla_generation_tokens_per_second", "hyla_decode_compilations"):
        assert name in text
    count = [ln for ln in text.splitlines()
             if ln.startswith("hyla_time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) > 0


def test_api_key(limited):
    no_key = httpx.post(f"{limited}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{limited}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{limited}/v1", api_key="sekrit", max_retries=0)
    r = good.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert httpx.get(f"{limited}/health").status_code == 200        # open without a key


def test_full_queue_is_429(limited):
    auth = {"Authorization": "Bearer sekrit"}
    long = {"prompt": "a", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    short = {"prompt": "b", "max_tokens": 2}
    results = {}
    with httpx.stream("POST", f"{limited}/v1/completions", json=long, headers=auth,
                      timeout=60) as running:
        lines = running.iter_lines()      # kept: a dropped iterator closes the connection
        next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(target=lambda: results.update(b=httpx.post(
            f"{limited}/v1/completions", json=short, headers=auth, timeout=60)))
        waiter.start()
        deadline = time.monotonic() + 20
        while httpx.get(f"{limited}/health").json()["waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        r = httpx.post(f"{limited}/v1/completions", json=short, headers=auth)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    waiter.join(timeout=60)       # the long stream closed: the queued request runs
    assert results["b"].status_code == 200
    h = _wait_idle(limited)
    assert (h["running"], h["waiting"], h["state_slots_used"]) == (0, 0, 0)
