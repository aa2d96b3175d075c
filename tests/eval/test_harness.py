"""lm-evaluation-harness on a small trained checkpoint and tiny local tasks (YAML + jsonl
written here, no network): ``hyla eval harness`` in process, its log-likelihoods against a
direct forward pass, and ``lm-eval``'s own ``local-completions`` model against a live
``hyla serve`` giving the same answers."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from hyla.data import ByteTokenizer  # noqa: E402
from hyla.eval.harness import HylaEvalLM, run_harness  # noqa: E402
from hyla.model import HylaLM, preset  # noqa: E402
from hyla.model.formats.checkpoint import save_checkpoint  # noqa: E402
from hyla.model.load import load_model  # noqa: E402

FACTS = [("The sky is", "blue"), ("Grass is", "green"), ("Blood is", "red"),
         ("Snow is", "white"), ("Coal is", "black"), ("The sun is", "yellow")]
COLORS = ["blue", "green", "red", "white", "black", "yellow"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A debug model trained for a few seconds on the facts, and the two tasks."""
    tmp = tmp_path_factory.mktemp("harness")
    torch.manual_seed(0)
    model, tok = HylaLM(preset("debug")), ByteTokenizer()
    docs = [tok.encode(f"{q} {a}. ") for q, a in FACTS]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(120):             # the facts in a new order each step
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(step))
        ids = torch.tensor([t for i in order.tolist() for t in docs[i]])[None]
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = save_checkpoint(model.eval(), tmp / "ckpt")
    tasks = tmp / "tasks"
    tasks.mkdir()
    with open(tasks / "colors.jsonl", "w") as f:
        for q, a in FACTS:
            f.write(json.dumps({"question": q, "choices": COLORS,
                                "answer": COLORS.index(a), "target": " " + a}) + "\n")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {tasks / 'colors.jsonl'}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (tasks / "colors_mc.yaml").write_text(
        "task: colors_mc\noutput_type: multiple_choice\n" + common
        + "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (tasks / "colors_gen.yaml").write_text(
        "task: colors_gen\noutput_type: generate_until\n" + common
        + "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n  until: [\".\"]\n"
        "  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n")
    return tmp, ckpt, tasks


def _direct(model, context: str, continuation: str) -> float:
    ids = ByteTokenizer().encode(context + continuation)
    n = len(ByteTokenizer().encode(continuation))
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor(ids)[None])[0].float(), -1)
    return float(lp[len(ids) - n - 1:-1].gather(1, torch.tensor(ids[-n:])[:, None]).sum())


def _choice_loglikelihoods(results, task: str) -> list[list[float]]:
    return [[r[0][0] if isinstance(r[0], list | tuple) else r[0] for r in s["resps"]]
            for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_hyla_eval_harness_cli_and_loglikelihoods(workdir):
    from hyla.cli.main import main

    tmp, ckpt, tasks = workdir
    assert main(["eval", "harness", "--checkpoint", str(ckpt), "--tasks",
                 "colors_mc,colors_gen", "--include-path", str(tasks), "--out",
                 str(tmp / "out"), "--batch-size", "4"]) == 0
    saved = json.loads((tmp / "out" / "results.json").read_text())
    assert set(saved["results"]) == {"colors_mc", "colors_gen"}
    model, tok = load_model(str(ckpt))
    r = run_harness(str(ckpt), ["colors_mc"], include_path=str(tasks), log_samples=True)
    got = _choice_loglikelihoods(r, "colors_mc")
    want = [[_direct(model, q, " " + c) for c in COLORS] for q, _ in FACTS]
    assert max(abs(a - b) for g, w in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True)) < 1e-4
    acc = sum(max(range(6), key=lambda i: w[i]) == COLORS.index(a)
              for w, (_, a) in zip(want, FACTS, strict=True)) / len(FACTS)
    assert r["results"]["colors_mc"]["acc,none"] == pytest.approx(acc)
    assert acc > 1 / 6                       # trained: better than chance on its facts
    assert saved["results"]["colors_mc"]["acc,none"] == pytest.approx(acc)


def test_rolling_loglikelihood_windows_sum_to_the_whole(workdir):
    from lm_eval.api.instance import Instance

    _, ckpt, _ = workdir
    model, tok = load_model(str(ckpt))
    text = "The sky is blue. Grass is green. Blood is red."
    lm = HylaEvalLM(model=model, tokenizer=tok, max_length=16, batch_size=3)
    req = Instance("loglikelihood_rolling", None, (text,), 0)
    (total,) = lm.loglikelihood_rolling([req])
    assert total < 0 and total != pytest.approx(_direct(model, "\0", text), abs=1e-3)
    whole = HylaEvalLM(model=model, tokenizer=tok, max_length=256)
    assert whole.loglikelihood_rolling([req])[0] == pytest.approx(
        _direct(model, "\0", text), abs=1e-4)   # one window: the prefix token is id 0


def test_a_task_that_needs_the_hub_fails_clearly(workdir, monkeypatch):
    _, ckpt, _ = workdir
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="need a download"):
        run_harness(str(ckpt), ["arc_easy"], limit=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_completions_against_hyla_serve_agrees(workdir):
    """lm-eval's own API model, with its remote tokenizer (hyla's /tokenize) and batched
    token-id prompts: the same log-likelihoods and the same accuracy as in process."""
    tmp, ckpt, tasks = workdir
    port = _free_port()
    log = open(tmp / "serve.log", "w+b")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyla", "serve", "--checkpoint", str(ckpt), "--port", str(port),
         "--threads", "1", "--log-level", "warning", "--max-model-len", "256",
         "--max-num-batched-tokens", "64", "--model-name", "m"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.seek(0) or log.read().decode()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(tasks), include_defaults=False)
        served = simple_evaluate(
            model="local-completions", tasks=["colors_mc", "colors_gen"],
            model_args={"base_url": f"{base}/v1/completions", "model": "m",
                        "max_length": 256, "batch_size": 4},
            task_manager=manager, log_samples=True, bootstrap_iters=0)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()
    local = run_harness(str(ckpt), ["colors_mc", "colors_gen"], include_path=str(tasks),
                        log_samples=True)
    a, b = _choice_loglikelihoods(served, "colors_mc"), _choice_loglikelihoods(local,
                                                                               "colors_mc")
    assert max(abs(x - y) for u, v in zip(a, b, strict=True)
               for x, y in zip(u, v, strict=True)) < 1e-4
    for task, metric in (("colors_mc", "acc,none"), ("colors_gen", "exact_match,none")):
        assert served["results"][task][metric] == local["results"][task][metric]
    gen = [s["filtered_resps"] for s in sorted(served["samples"]["colors_gen"],
                                               key=lambda s: s["doc_id"])]
    assert gen == [s["filtered_resps"] for s in sorted(local["samples"]["colors_gen"],
                                                       key=lambda s: s["doc_id"])]


def test_eval_harness_quantised(workdir, capsys):
    from hyla.cli.main import main

    tmp, ckpt, tasks = workdir
    assert main(["eval", "harness", "--checkpoint", str(ckpt), "--tasks", "colors_mc",
                 "--include-path", str(tasks), "--out", str(tmp / "q"), "--quantize",
                 "int8"]) == 0
    assert "quantised" in capsys.readouterr().out
    saved = json.loads((tmp / "q" / "results.json").read_text())
    assert 0 <= saved["results"]["colors_mc"]["acc,none"] <= 1
