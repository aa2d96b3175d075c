"""transformers interop: Llama / Mistral / Qwen2 directories load with equal logits; export
round-trips; unsupported input is refused naming the file and the field."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer, train_bpe
from hyla.model import HylaLM, preset
from hyla.model.formats.hf import export_hf, is_hf_directory, load_hf

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             tie_word_embeddings=False)



@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)


def _hf_dir(tmp_path, kind, bpe, **overrides):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    kw = SHAPE | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}} | overrides
    if kind == "mistral":
        kw["sliding_window"] = None
    torch.manual_seed(0)
    model = cls[1](cls[0](**kw)).eval()
    with torch.no_grad():  # non-trivial norms, so a transposed or misnamed weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return path, model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_matches_transformers_logits(tmp_path, bpe, kind, tied):
    path, ref = _hf_dir(tmp_path, kind, bpe, tie_word_embeddings=tied)
    assert is_hf_directory(path)
    model, tok = load_hf(path)
    assert model.cfg.layers == "AA" and model.cfg.n_kv_heads == 2
    assert model.cfg.rope_theta == 5000.0 and model.cfg.norm_eps == 1e-5
    assert model.cfg.tie_embeddings == tied
    ids = torch.randint(0, VOCAB, (2, 45))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert tok.encode("def f(x):") == bpe.encode("def f(x):")



def test_a_directory_without_tokenizer_loads_and_commands_that_need_text_say_so(tmp_path, bpe,
                                                                              capsys):
    """What a trainer's checkpoint or a random-init config looks like: config.json and
    safetensors, no tokenizer.json. transformers loads it; so does hyla, without a tokenizer,
    and exports it; commands that read or write text refuse it in one line."""
    from hyla.cli.main import main
    from hyla.model import load_model

    path, ref = _hf_dir(tmp_path, "llama", bpe)
    (path / "tokenizer.json").unlink()
    model, tok = load_model(path)
    assert tok is None
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert main(["export", str(path), str(tmp_path / "out"), "--format", "llama"]) == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    capsys.readouterr()
    for argv in (["generate", "--checkpoint", str(path), "--prompt", "x", "--max-tokens", "2"],
                 ["eval", "ppl", "--checkpoint", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "needs a tokenizer" in err and "tokenizer.json" in err, err
        assert "Traceback" not in err

def test_export_round_trip(tmp_path, bpe):
    cfg = dataclasses.replace(preset("debug"), layers="AAA", vocab_size=VOCAB, rope_theta=500.0,
                              norm_eps=1e-5)
    torch.manual_seed(1)
    model = HylaLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = export_hf(model, bpe, tmp_path / "export")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, model(ids), atol=1e-4, rtol=1e-4)
        back, tok = load_hf(out)
        torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("def f(x):")["input_ids"] == bpe.encode("def f(x):") == tok.encode("def f(x):")


def test_export_byte_tokenizer(tmp_path):
    model = HylaLM(dataclasses.replace(preset("debug"), layers="A"))
    out = export_hf(model, ByteTokenizer(), tmp_path / "bytes")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("hé!")["input_ids"] == list("hé!".encode())
    assert isinstance(load_hf(out)[1], ByteTokenizer)


def test_export_refuses_gla_layers(tmp_path):
    with pytest.raises(ValueError, match="all 'A'"):
        export_hf(HylaLM(preset("debug")), ByteTokenizer(), tmp_path / "x")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "missing.*'factor'"),
    ({"head_dim": 32},
     r"model.layers.0.self_attn.q_proj.weight \(hyla's blocks.0.mixer.q_proj.weight\) has"),
    ({"vocab_size": 200}, "has shape"),
    # a newcomer's config.json: int()'s "invalid literal ... 'big'" named neither
    ({"hidden_size": "big"}, "hidden_size must be an int >= 1, got 'big'"),
    ({"num_hidden_layers": -3}, "num_hidden_layers must be an int >= 1, got -3"),
    ({"vocab_size": None}, "vocab_size must be an int >= 1, got None"),
    ({"num_key_value_heads": 1.5}, "num_key_value_heads must be an int"),
], ids=["arch", "act", "rope", "rope-params", "head_dim", "vocab", "str-width",
        "negative-layers", "null-vocab", "float-heads"])
def test_bad_config(tmp_path, bpe, changes, match):
    path, _ = _hf_dir(tmp_path, "llama", bpe)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as err:
        load_hf(path)
    assert str(path) in str(err.value)


def test_tokenizer_mismatch(tmp_path, bpe):
    path, _ = _hf_dir(tmp_path, "llama", bpe)
    words = [" ".join(f"w{i * j % 997}x{j}" for j in range(60)) for i in range(60)]
    big = train_bpe(words, vocab_size=VOCAB + 50)
    assert big.vocab_size > VOCAB
    big.save(path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer mismatch.*tokenizer.json"):
        load_hf(path)


def test_undeclared_tensor_refused(tmp_path, bpe):
    """A tensor the config does not declare (here Llama's biases with attention_bias
    false) would be dropped: refused, naming it."""
    path, _ = _hf_dir(tmp_path, "llama", bpe, attention_bias=True)
    _edit_config(path, attention_bias=False)
    with pytest.raises(ValueError, match=r"does not account for.*layers\.0\.self_attn"):
        load_hf(path)


def test_pickled_weights_refused(tmp_path, bpe):
    path, _ = _hf_dir(tmp_path, "llama", bpe)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_hf(path)
