"""load_model: one loader for every source; the CLI commands take any of them."""

from __future__ import annotations

import pytest
import torch

from hyla.cli.main import main
from hyla.model import HylaLM, load_model, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.load import load_tokenizer, model_name, resolve_source, source_kind

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from hyla.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=296).save(path / "tokenizer.json")
    return path


def test_each_source_kind(tmp_path, llama_dir):
    hyla_dir = save_checkpoint(HylaLM(preset("debug")), tmp_path / "run" / "ckpt-00000003")
    assert source_kind(hyla_dir) == "hyla" and source_kind(tmp_path / "run") == "hyla"
    assert source_kind(llama_dir) == "hf"
    model, tok = load_model(tmp_path / "run", dtype=torch.float64)
    assert model.cfg.layers == "GGGA" and model.embed.weight.dtype == torch.float64
    model, tok = load_model(str(llama_dir))
    assert model.cfg.layers == "AA" and not model.training
    assert load_tokenizer(llama_dir).encode("def f") == tok.encode("def f")
    assert model_name(llama_dir) == llama_dir.name


def test_refusals_name_the_source(tmp_path):
    with pytest.raises(ValueError, match="not found: /no/such/place"):
        load_model("/no/such/place")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="weights.bin.*not a .gguf file"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty' has no config.json"):
        load_model(tmp_path / "empty")


def test_hub_id_offline_names_the_id(monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def offline(*args, **kwargs):     # no network in tests: the hub is unreachable
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="'someorg/some-model'.*hub could not provide it"):
        resolve_source("someorg/some-model")
    assert model_name("someorg/some-model") == "some-model"


def test_cli_commands_take_a_transformers_directory(tmp_path, llama_dir, capsys):
    assert main(["generate", "--checkpoint", str(llama_dir), "--prompt", "def",
                 "--max-tokens", "3", "--temperature", "0"]) == 0
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 20)
    assert main(["eval", "ppl", "--checkpoint", str(llama_dir), "--data", str(data),
                 "--seq-len", "32", "--max-tokens", "64", "--json"]) == 0
    assert main(["export", "--checkpoint", str(llama_dir), str(tmp_path / "out")]) == 0
    back, _ = load_model(tmp_path / "out")
    ref, _ = load_model(llama_dir)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), ref(ids), atol=0, rtol=0)


def test_train_init_starts_from_a_source(tmp_path, llama_dir):
    from hyla.train.config import TrainConfig
    from hyla.train.trainer import Trainer

    cfg = TrainConfig(init=str(llama_dir), steps=1, seq_len=16, batch_size=1, eval_batches=1,
                      optimizer="adamw", out=str(tmp_path / "run"), save_every=1)
    trainer = Trainer(cfg)
    ref, _ = load_model(llama_dir)
    assert trainer.model.cfg == ref.cfg
    torch.testing.assert_close(trainer.model.embed.weight, ref.embed.weight)
    trainer.fit(progress=False)
    model, tok = load_model(tmp_path / "run")
    assert model.cfg.layers == "AA" and tok.encode("def f") == load_tokenizer(llama_dir).encode(
        "def f")
