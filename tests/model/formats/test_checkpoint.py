import dataclasses
import json

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_round_trip_gives_identical_logits(tmp_path, tie):
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(preset("debug"), tie_embeddings=tie)).eval()
    save_checkpoint(model, tmp_path)
    loaded, tok = load_checkpoint(tmp_path)
    ids = torch.tensor([tok.encode("round trip")])
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert loaded.cfg == model.cfg
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.embed.weight.data_ptr()


def test_bad_checkpoints_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_checkpoint(tmp_path / "missing")
    save_checkpoint(HylaLM(preset("debug")), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors could not be read"):
        load_checkpoint(tmp_path)
    other = tmp_path / "other"
    save_checkpoint(HylaLM(preset("debug")), other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["layers"] = "GGGAG"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(other)
    (other / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json is not a valid"):
        load_checkpoint(other)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = HylaLM(preset("debug"))
    save_checkpoint(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hyla.model.formats.checkpoint.save_file", crash)
    with pytest.raises(OSError):
        save_checkpoint(HylaLM(preset("debug")), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
