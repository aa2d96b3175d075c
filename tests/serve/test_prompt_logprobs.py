"""Prompt log-probabilities (``echo``), ``max_tokens: 0`` and batched prompts, what
lm-evaluation-harness's log-likelihood requests need: in the engine (chunked prefill, the
prefix cache) and through a real ``hyla serve`` driven by the official ``openai`` client,
every value checked against the model's own log-softmax on the prompt (fp32)."""

import dataclasses
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

TOL = 1e-5


def _model(seed: int = 0, layers: str = "GGGA") -> HylaLM:
    torch.manual_seed(seed)
    model = HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()
    with torch.no_grad():       # sharper than the default init: logprobs far from uniform
        model.lm_head.weight.mul_(20)
    return model


def _reference(model: HylaLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each prompt token after the first [T-1], log-softmax rows [T, V])."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor(ids)[None])[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lp


def _run(eng: Engine, requests: dict) -> dict:
    for rid, (ids, params) in requests.items():
        eng.add_request(ids, params, rid)
    outs: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("layers", ["GGGA", "AAAA", "GGGG"])
def test_engine_prompt_logprobs_chunked_and_cached(layers):
    model = _model(layers=layers)
    # chunks of 24 tokens (cut again at the 16-token snapshot boundaries): a 90-token
    # prompt spans several prefill steps
    eng = Engine(model, None, EngineConfig(max_num_batched_tokens=24, max_model_len=256,
                                           block_size=8, snapshot_interval=16))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (90,), generator=g).tolist()
    want, rows = _reference(model, prompt)
    p = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=3)
    for rnd in range(2):            # the second round finds the prompt in the prefix cache
        outs = _run(eng, {f"score{rnd}": (prompt, p),
                          f"plain{rnd}": (prompt[:70], SamplingParams(max_tokens=2))})
        (o,) = outs[f"score{rnd}"]
        assert o.finished and o.finish_reason == "length" and o.token_ids == []
        assert o.num_output_tokens == 0 and len(o.prompt_logprobs) == len(prompt)
        assert o.prompt_logprobs[0] is None
        got = torch.tensor([x.logprob for x in o.prompt_logprobs[1:]])
        assert (got - want).abs().max() < TOL
        assert [x.token for x in o.prompt_logprobs[1:]] == prompt[1:]
        for i in (1, 40, 89):
            top = o.prompt_logprobs[i].top
            assert [t for t, _ in top] == rows[i - 1].topk(3).indices.tolist()
        assert outs[f"plain{rnd}"][-1].finished
    if eng.scheduler.prefix_cache is not None and layers != "GGGG":
        assert eng.scheduler.prefix_cache.hit_rate > 0     # the plain request hit it
    assert eng.scheduler.pool.num_used == 0


def test_engine_prompt_logprobs_with_generated_tokens():
    model = _model()
    eng = Engine(model, None, EngineConfig(max_num_batched_tokens=16, max_model_len=128))
    prompt = list(range(30, 70))
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, logprobs=0)
    outs = _run(eng, {"a": (prompt, p), "b": (prompt[:5], p)})
    first = outs["a"][0]
    assert len(first.prompt_logprobs) == 40 and all(x.top == [] for x in
                                                   first.prompt_logprobs[1:])
    assert all(o.prompt_logprobs is None for o in outs["a"][1:])
    assert sum(len(o.token_ids) for o in outs["a"]) == 3
    want, _ = _reference(model, prompt)
    got = torch.tensor([x.logprob for x in first.prompt_logprobs[1:]])
    assert (got - want).abs().max() < TOL


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=21)


# -- through hyla serve, with the openai client -----------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("echo")
    model = _model()
    ckpt = save_checkpoint(model, tmp / "ckpt")
    port = _free_port()
    log = open(tmp / "server.log", "w+b")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyla", "serve", "--checkpoint", str(ckpt), "--port", str(port),
         "--threads", "1", "--log-level", "warning", "--max-model-len", "256",
         "--max-num-batched-tokens", "32", "--model-name", "m"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited:\n{log.read().decode()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up in 90 s"
        time.sleep(0.2)
    yield base, model
    proc.terminate()
    proc.wait(timeout=15)
    log.close()


def test_echo_through_the_openai_client(served):
    base, model = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    want, rows = _reference(model, prompt)
    for max_tokens in (0, 1):           # 100 tokens: four prefill chunks of 32 at most
        for _ in range(2):              # the second time the prefix cache holds the prompt
            r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                          logprobs=1, echo=True, temperature=0)
            lp = r.choices[0].logprobs
            assert len(lp.tokens) == 100 + max_tokens and lp.token_logprobs[0] is None
            got = torch.tensor(lp.token_logprobs[1:100])
            assert (got - want).abs().max() < TOL
            assert lp.top_logprobs[0] is None and lp.text_offset[:3] == [0, 1, 2]
            assert max(lp.top_logprobs[50].values()) == pytest.approx(
                rows[49].max().item(), abs=TOL)
            assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == max_tokens
            assert r.choices[0].finish_reason == "length"
    if max_tokens:                       # the generated token: greedy, its logprob right
        assert lp.token_logprobs[100] == pytest.approx(rows[99].max().item(), abs=TOL)


def test_batched_prompts_and_text_echo(served):
    base, model = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = [[5, 6, 7, 8], list(range(40, 80)), [9, 10]]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=1, logprobs=1,
                                  echo=True, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, ids in zip(r.choices, prompts, strict=True):
        want, _ = _reference(model, ids)
        got = torch.tensor(c.logprobs.token_logprobs[1:len(ids)])
        assert (got - want).abs().max() < TOL
    assert r.usage.prompt_tokens == 46 and r.usage.completion_tokens == 3
    t = client.completions.create(model="m", prompt="Hello", max_tokens=2, echo=True,
                                  temperature=0)
    assert t.choices[0].text.startswith("Hello") and t.choices[0].logprobs is None
    many = client.completions.create(model="m", prompt=["ab", "cd"], max_tokens=2,
                                     temperature=0)
    one = client.completions.create(model="m", prompt="cd", max_tokens=2, temperature=0)
    assert many.choices[1].text == one.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", "b"], "stream": True}, "stream"),
    ({"prompt": [[1]] * 300}, "prompt"),
])
def test_bad_echo_and_batch_requests(served, body, param):
    r = httpx.post(f"{served[0]}/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenizer_routes(served):
    base = served[0]
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    assert ids.json()["tokens"] == [104, 105]
    assert httpx.post(f"{base}/detokenize", json={"tokens": [104, 105]}).json() == {
        "prompt": "hi"}
    assert "eos_token" in httpx.get(f"{base}/tokenizer_info").json()
