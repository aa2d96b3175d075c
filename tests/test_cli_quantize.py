"""``--quantize`` on ``hyla chat`` and the ``hyla eval`` commands that load a checkpoint:
the weights are quantised (said on the console), the figures stay close to the fp32 ones,
and a use that cannot be quantised is refused with one line naming the scheme."""

from __future__ import annotations

import io
import json

import pytest

from hyla.cli.main import main
from hyla.model import HylaLM, preset


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hyla.model import HylaLM, preset
    from hyla.model.formats.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("q") / "ckpt"
    save_checkpoint(HylaLM(preset("debug")), path)
    data = path.parent / "d.txt"
    data.write_text("print('hello world')\n" * 40)
    return path, data


def _ppl(capsys, checkpoint, scheme: str) -> float:
    path, data = checkpoint
    assert main(["eval", "ppl", "--checkpoint", str(path), "--data", str(data), "--seq-len",
                 "64", "--max-tokens", "256", "--json", "--quantize", scheme]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]


def test_eval_ppl_quantised_is_close_to_fp32(capsys, checkpoint):
    full = _ppl(capsys, checkpoint, "none")
    for scheme in ("int8", "int4"):
        assert abs(_ppl(capsys, checkpoint, scheme) / full - 1) < 0.05, scheme


def test_eval_needle_says_it_quantised(capsys, checkpoint, tmp_path):
    path, _ = checkpoint
    assert main(["eval", "needle", "--checkpoint", str(path), "--context", "128", "--depths",
                 "0.5", "--trials", "1", "--out", str(tmp_path), "--quantize", "int8"]) == 0
    assert "quantised" in capsys.readouterr().out and (tmp_path / "needle.json").is_file()


def test_chat_quantised(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/exit\n"))
    assert main(["chat", "--preset", "debug", "--max-tokens", "3", "--temperature", "0",
                 "--threads", "1", "--quantize", "int4"]) == 0
    err = capsys.readouterr().err
    assert "to int4" in err and "3 tokens at" in err


def test_quantize_refused_where_it_cannot_run(capsys):
    assert main(["eval", "recall", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--quantize int8" in err and "--checkpoint" in err and "Traceback" not in err
    assert main(["chat", "--preset", "debug", "--quantize", "int3"]) == 2
    assert "int3" in capsys.readouterr().err


def test_serve_logs_the_kv_reservation_and_refuses_too_small_a_budget(monkeypatch, capsys):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)    # start, do not serve
    monkeypatch.setattr("hyla.cli.serve.warm_up", lambda *a, **k: None, raising=False)
    assert main(["serve", "--preset", "debug", "--max-num-seqs", "2", "--max-model-len", "64",
                 "--kv-cache-dtype", "bfloat16", "--port", "18431"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 8 blocks of 16 tokens in bfloat16" in out and "2 full-length" in out
    assert main(["serve", "--preset", "debug", "--max-model-len", "64", "--kv-cache-memory",
                 "1000", "--port", "18431"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory 1000" in err and "at least" in err and "Traceback" not in err


@pytest.mark.parametrize("kind, scheme", [("Q4_1", "int4"), ("Q4_0", "int4"), ("Q8_0", "int8"),
                                          ("F16", "none")])
def test_auto_takes_the_scheme_nearest_a_gguf_files_own(tmp_path, monkeypatch, kind, scheme):
    gguf = pytest.importorskip("gguf")
    from rich.console import Console

    from hyla.cli.model_flags import apply_quantize, resolve_quantize
    from hyla.model.load import load_model
    from tests.model.formats.test_gguf_direct import write_tiny_llama

    path = tmp_path / f"tiny-{kind}.gguf"
    write_tiny_llama(path, kinds=[getattr(gguf.GGMLQuantizationType, kind)])
    model, _ = load_model(path)
    assert model.source_quantization == (kind, scheme)
    assert resolve_quantize(model, "int8") == ("int8", "")        # a named scheme is kept
    said = io.StringIO()
    apply_quantize(model, type("A", (), {"quantize": "auto"})(), Console(file=said))
    # where VNNI runs, decode batches take 8-bit activations, as llama.cpp's do
    from hyla.model.vnni_int8 import vnni_int8_available

    want = f"{scheme}-a8" if scheme != "none" and vnni_int8_available() else scheme
    assert getattr(model, "quantized", "none") == want
    if scheme != "none":
        assert f"to {want} " in said.getvalue() and kind in said.getvalue()
        # without VNNI, the plain scheme (-a8 would be refused there)
        import hyla.model.vnni_int8 as vnni

        monkeypatch.setattr(vnni, "vnni_int8_available", lambda: False)
        assert resolve_quantize(load_model(path)[0], "auto")[0] == scheme
    if scheme != "none":
        # off the CPU, auto (and a named scheme) keeps the float weights and says why
        fresh, _ = load_model(path)
        got, why = resolve_quantize(fresh.to("meta"), "auto")
        assert got == "none" and kind in why and "CPU only" in why
        got, why = resolve_quantize(fresh, "int4")
        assert got == "none" and "--quantize int4" in why and "CPU only" in why


def test_a_scheme_this_cpu_cannot_run_falls_back_with_the_reason(monkeypatch):
    from rich.console import Console

    import hyla.model.vnni_int8 as vnni
    from hyla.cli.model_flags import apply_quantize, resolve_quantize

    model = HylaLM(preset("debug")).eval()
    monkeypatch.setattr(vnni, "vnni_int8_available", lambda: False)
    got, why = resolve_quantize(model, "int4-a8")
    assert got == "int4" and "AVX512-VNNI" in why and "16-bit activations" in why
    said = io.StringIO()
    apply_quantize(model, type("A", (), {"quantize": "int8-a8"})(), Console(file=said))
    assert model.quantized == "int8" and "int8-a8" in said.getvalue()
    monkeypatch.setattr(vnni, "vnni_int8_available", lambda: True)
    assert resolve_quantize(HylaLM(preset("debug")), "int4-a8") == ("int4-a8", "")


def test_auto_leaves_a_float_checkpoint_float(capsys, checkpoint):
    path, data = checkpoint
    assert main(["eval", "ppl", "--checkpoint", str(path), "--data", str(data), "--seq-len",
                 "64", "--max-tokens", "128"]) == 0
    assert "quantised" not in capsys.readouterr().out


def test_generate_chat_and_serve_read_prepared_weights_the_second_time(tmp_path, monkeypatch,
                                                                        capsys):
    """The second start of a GGUF under ``--quantize`` reads the prepared-weights cache: the
    same tokens from generate, the same tokenizer (chat template, special tokens) and logits
    for serve; ``--no-weights-cache`` goes back to the file."""
    gguf = pytest.importorskip("gguf")
    import argparse

    import torch

    from hyla.cli.serve import load_serving
    from hyla.serve.startup import StartupClock
    from tests.model.formats.test_gguf_direct import write_tiny_llama

    cache = tmp_path / "cache"
    monkeypatch.setenv("HYLA_WEIGHTS_CACHE", str(cache))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, kinds=[gguf.GGMLQuantizationType.Q4_1])
    run = ["generate", "--checkpoint", str(path), "--prompt", "the then", "--max-tokens", "8",
           "--temperature", "0", "--quiet"]
    outputs = []
    for extra in ([], [], ["--no-weights-cache"]):
        assert main([*run, *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and len(list(cache.iterdir())) == 1

    def serve_args(**kw):
        ns = dict(checkpoint=str(path), preset=None, quantize="auto", dtype="auto",
                  device="cpu", no_weights_cache=False, allow_nonfinite=False, seed=0)
        return argparse.Namespace(**(ns | kw))

    out = io.StringIO()
    from rich.console import Console

    fresh = load_serving(serve_args(no_weights_cache=True), Console(file=out), StartupClock())
    load_serving(serve_args(), Console(file=out), StartupClock())      # writes the entry
    assert "prepared weights read" not in out.getvalue()
    hit = load_serving(serve_args(), Console(file=out), StartupClock())
    said = out.getvalue()
    assert "prepared weights read from" in said and said.count("quantised") == 3
    (m1, t1, n1), (m2, t2, n2) = fresh, hit
    assert n1 == n2 and m1.quantized == m2.quantized
    assert (t1.eos_id, t1.bos_token, t1.chat_template, t1.stop_ids) == \
        (t2.eos_id, t2.bos_token, t2.chat_template, t2.stop_ids)
    text = "<|im_start|>the then there<|im_end|>"
    assert t1.encode(text) == t2.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert t1.apply_chat_template(msgs) == t2.apply_chat_template(msgs)
    ids = torch.tensor([t1.encode("the then there")])
    with torch.no_grad():
        assert torch.equal(m1(ids), m2(ids))
