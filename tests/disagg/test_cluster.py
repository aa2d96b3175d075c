"""``hyla cluster`` as users run it: a router, 2 prefill and 2 decode worker processes
(debug preset), driven by the official ``openai`` client; then faults under concurrent load:
corrupt, mismatched and stalled transfers, a prefill worker and a decode worker killed with
SIGKILL mid-request. Every request must complete or fail with a clear error.

The tests share one cluster and run in order (the last two kill workers)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from hyla.disagg.live.internal_auth import InternalAuth, internal_key

MODEL = "hyla-debug"
SECRET = "cluster-test-secret"
SIGNED = InternalAuth(internal_key(SECRET), role="test")     # /internal/* calls are signed
LONG = "the quick brown fox jumps over the lazy dog. " * 3     # > threshold: remote
SHORT = "hi"                                                      # local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster")
    port = _free_port()
    out = open(logs / "cluster.out", "w+b")  # noqa: SIM115 - closed at teardown
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYLA_FAULTS="1", HYLA_CLUSTER_SECRET=SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyla", "cluster", "--preset", "debug", "--port", str(port),
         "--prefill-workers", "2", "--decode-workers", "2", "--threshold", "32",
         "--transfer-timeout", "4", "--max-model-len", "512", "--log-dir", str(logs)],
        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def dump() -> str:
        out.seek(0)
        text = out.read().decode(errors="replace")[-2000:]
        for f in sorted(logs.glob("*.log")):
            text += f"\n--- {f.name}\n" + f.read_text(errors="replace")[-1500:]
        return text
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"hyla cluster exited ({proc.returncode}):\n{dump()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"cluster did not come up in 180 s:\n{dump()}")
            time.sleep(0.3)
        yield base
    except BaseException:
        print(dump())
        raise
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()


def _view(base):
    return httpx.get(f"{base}/cluster", timeout=10).json()


def _workers(base, role):
    return [w for w in _view(base)["workers"] if w["role"] == role]


def _fault(base, role, body):
    for w in _workers(base, role):
        if w["healthy"]:
            httpx.post(f"{w['address']}/internal/fault", json=body, timeout=10,
                       auth=SIGNED).raise_for_status()


def _reference(base, prompt, max_tokens):
    """The greedy completion a decode worker computes on its own (no router)."""
    w = [w for w in _workers(base, "decode") if w["healthy"]][0]
    r = httpx.post(f"{w['address']}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["text"]


def test_openai_client_through_the_router(cluster):
    view = _view(cluster)
    roles = sorted(w["role"] for w in view["workers"])
    assert roles == ["decode", "decode", "prefill", "prefill"]
    for w in view["workers"]:
        assert w["healthy"] and w["address"].startswith("http://127.0.0.1:")
        os.kill(w["pid"], 0)                           # a live process
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    ref = _reference(cluster, LONG, 12)
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref and r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=1, temperature=0)
    assert r.choices[0].text == ref[:len(r.choices[0].text)] and r.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=5000)
    counts = _view(cluster)["counts"]
    assert counts["remote_ok"] >= 3 and counts["local"] >= 1 and counts["failed"] == 0


def test_structured_output_through_the_router(cluster):
    """A grammar rides with the request: the prefill worker masks the first token, the
    decode worker owns the matcher for the rest; a bad grammar is a 400 naming it."""
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    before = _view(cluster)["counts"]["remote_ok"]
    for prompt in (LONG, SHORT):            # shipped to a decode worker, and local
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                      temperature=1.0, seed=3,
                                      extra_body={"guided_regex": "(ab|cd){2,4}!"})
        assert re.fullmatch("(ab|cd){2,4}!", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    assert _view(cluster)["counts"]["remote_ok"] > before, _view(cluster)["counts"]
    with pytest.raises(openai.BadRequestError, match="regular expression"):
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=5,
                                  extra_body={"guided_regex": "(ab"})


def test_prompt_logprobs_and_batches_through_the_router(cluster):
    """lm-evaluation-harness's log-likelihood request (echo, logprobs, max_tokens 0 or 1,
    a batch of token-id prompts) through the router: the prompt logprobs a decode worker
    computes on its own, even for a prompt long enough to go remote otherwise."""
    w = [w for w in _workers(cluster, "decode") if w["healthy"]][0]
    long_ids = list(range(60, 160))                 # over the threshold (32)
    for max_tokens in (0, 1):
        body = {"prompt": [long_ids, [5, 6, 7]], "max_tokens": max_tokens, "logprobs": 1,
                "echo": True, "temperature": 0}
        via = httpx.post(f"{cluster}/v1/completions", json=body, timeout=60).json()
        direct = httpx.post(f"{w['address']}/v1/completions", json=body, timeout=60).json()
        for a, b in zip(via["choices"], direct["choices"], strict=True):
            la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
            assert la[0] is None and len(la) == len(lb)
            assert max(abs(x - y) for x, y in zip(la[1:], lb[1:], strict=True)) < 1e-5
            assert a["text"] == b["text"]
        assert via["usage"] == direct["usage"]
    assert httpx.post(f"{cluster}/tokenize", json={"prompt": "hi"}).json()["tokens"] == [104,
                                                                                         105]


def test_next_turn_ships_only_what_the_decode_worker_has_not_cached(cluster):
    """A conversation's next turn goes remote to the decode worker that served the first
    (the router's index of its KV blocks, answers included), which is sent the state without
    the rows of the prefix its cache holds: the answer is a local prefill's."""
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    turn = "a sleepy cat naps in the warm sun by the old gate. " * 6    # 306 tokens, new
    before = _view(cluster)["counts"]
    answer = client.completions.create(model=MODEL, prompt=turn, max_tokens=8,
                                       temperature=0).choices[0].text
    prompt = turn + answer + " then a dog woke up and chased the cat around the yard."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    counts = _view(cluster)["counts"]
    assert counts["remote_ok"] - before["remote_ok"] == 2
    assert counts["shipped_after_prefix"] - before["shipped_after_prefix"] == 1
    held = counts["prefix_tokens_not_shipped"] - before["prefix_tokens_not_shipped"]
    # at least the first turn's 16 whole blocks (the random model's answer bytes come back
    # as other text, so its blocks do not match)
    assert 256 <= held <= len(prompt) and held % 16 == 0
    hits = sum(httpx.get(f"{w['address']}/internal/info", auth=SIGNED, timeout=10).json()
               ["shipped_prefix"]["hits"] for w in _workers(cluster, "decode"))
    assert hits >= 1
    assert r.choices[0].text == _reference(cluster, prompt, 8)


@pytest.mark.parametrize("fault,reason", [
    ({"corrupt": True}, "checksum"),
    ({"fingerprint": "0000000000000000"}, "fingerprint"),
    ({"stall_after_chunks": 1}, "did not complete|stalled|no acknowledgement"),
])
def test_bad_transfer_reruns_locally(cluster, fault, reason):
    import re

    ref = _reference(cluster, LONG, 6)
    before = _view(cluster)["counts"]["fallback_local"]
    _fault(cluster, "prefill", fault)
    try:
        r = httpx.post(f"{cluster}/v1/completions", timeout=60,
                       json={"prompt": LONG, "max_tokens": 6, "temperature": 0})
    finally:
        _fault(cluster, "prefill", {"clear": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    view = _view(cluster)
    assert view["counts"]["fallback_local"] == before + 1
    assert any(re.search(reason, e) for e in view["last_errors"]), view["last_errors"]


async def _one(client, base, i, stream, prompt, max_tokens):
    """(status, outcome) of one request: 'ok', or 'error: ...' with a clear message."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = await client.post(f"{base}/v1/completions", json=body)
        j = r.json()
        if r.status_code == 200:
            ok = j["usage"]["completion_tokens"] == max_tokens
            return "ok" if ok else f"short: {j}"
        return f"error: {j['error']['message']}"
    done, n, err = False, 0, None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"error: {(await r.aread()).decode()}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"]["message"]
                elif d["choices"][0]["finish_reason"]:
                    n += 1
    if err:
        return f"error: {err}"
    return "ok" if done and n == 1 else f"silently truncated (done={done})"


async def _load(base, kill_pid, kill_after, n=8, max_tokens=24):
    async with httpx.AsyncClient(timeout=120) as client:
        # distinct prompts: with one shared prefix, remote requests would go to the decode
        # worker caching it (up to its slack), and the victim might hold none of them
        tasks = [asyncio.create_task(_one(client, base, i, i % 2 == 0,
                                          f"{i} {LONG}" if i % 4 < 3 else SHORT, max_tokens))
                 for i in range(n)]
        await asyncio.sleep(kill_after)
        os.kill(kill_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_prefill_worker_sigkilled_mid_request(cluster):
    _fault(cluster, "prefill", {"prefill_delay_s": 1.2})   # a slow prefill: killed mid-way
    victim = _workers(cluster, "prefill")[0]
    try:
        outcomes = asyncio.run(_load(cluster, victim["pid"], 0.8))
    finally:
        _fault(cluster, "prefill", {"clear": True})
    # The prefill pool lost a worker, but the decode pool is intact: everything completes.
    assert outcomes == ["ok"] * len(outcomes), outcomes
    view = _view(cluster)
    assert view["counts"]["fallback_local"] >= 1, view
    dead = [w for w in view["workers"] if w["pid"] == victim["pid"]][0]
    assert dead["health"] == "down"


def test_decode_worker_killed_mid_stream(cluster):
    _fault(cluster, "decode", {"stream_delay_s": 0.05})
    victim = _workers(cluster, "decode")[0]
    outcomes = asyncio.run(_load(cluster, victim["pid"], 0.8, max_tokens=30))
    _fault(cluster, "decode", {"clear": True})
    for i, o in enumerate(outcomes):
        if i % 2:                     # non-streaming: re-run on the survivor
            assert o == "ok", outcomes
        else:                         # streaming: complete, or a clear error event
            assert o == "ok" or ("interrupted" in o and "retry" in o), outcomes
    c = _view(cluster)["counts"]
    assert c["decode_retries"] + c["failed_mid_stream"] >= 1, c     # the kill hit requests
    # The cluster still serves, through the surviving decode worker.
    r = httpx.post(f"{cluster}/v1/completions", timeout=60,
                   json={"prompt": LONG, "max_tokens": 4})
    assert r.status_code == 200
    down = [w for w in _view(cluster)["workers"] if w["health"] == "down"]
    assert {w["role"] for w in down} == {"prefill", "decode"}
