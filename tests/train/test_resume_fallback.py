"""``--resume`` falls back to the newest intact checkpoint and says which; it accepts a
``ckpt-<step>`` directory (issue 15, item 12). A checkpoint without its tokenizer is an error
naming the file (item 9)."""

import json

import pytest

from hyla.data.tokenizer import ByteTokenizer, load_tokenizer
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.train.config import TrainConfig
from hyla.train.trainer import Trainer


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=4, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=2, eval_batches=1, warmup_steps=1,
                keep_last=3, out=str(out))
    return TrainConfig(**(base | kw))


@pytest.fixture
def run(tmp_path):
    out = tmp_path / "run"
    Trainer(tiny(out)).fit(progress=False)
    assert [p.name for p in sorted(out.glob("ckpt-*"))] == ["ckpt-000002", "ckpt-000004"]
    return out


def test_truncated_newest_checkpoint_falls_back(run, capsys):
    weights = run / "ckpt-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])          # truncated mid-write
    resumed = Trainer(TrainConfig(out=str(run)), resume=str(run))
    assert resumed.step == 2
    err = capsys.readouterr().err
    assert "ckpt-000002" in err and "skipped ckpt-000004" in err
    state = run / "ckpt-000004" / "train_state.pt"
    state.write_bytes(b"")
    assert Trainer(TrainConfig(out=str(run)), resume=str(run)).step == 2


def test_resume_accepts_a_checkpoint_directory(run):
    resumed = Trainer(TrainConfig(out=str(run)), resume=str(run / "ckpt-000002"))
    assert resumed.step == 2 and resumed.out == run
    assert resumed.fit(progress=False)["step"] == 4
    assert not (run / "ckpt-000002" / "ckpt-000004").exists()


def test_no_intact_checkpoint_names_each(run):
    for c in run.glob("ckpt-*"):
        (c / "train_state.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="ckpt-000004 .*ckpt-000002"):
        Trainer(TrainConfig(out=str(run)), resume=str(run))


def test_missing_tokenizer_is_an_error_naming_the_file(tmp_path):
    cfg = preset("debug")
    save_checkpoint(HylaLM(cfg), tmp_path / "bytes")         # 256 ids: the byte tokenizer
    assert isinstance(load_checkpoint(tmp_path / "bytes")[1], ByteTokenizer)
    big = tmp_path / "big"
    save_checkpoint(HylaLM(preset("debug")), big)
    conf = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(conf | {"vocab_size": 300}))
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        load_tokenizer(big)


def test_config_that_does_not_match_its_weights_is_one_line_before_allocating(tmp_path):
    """Item 8: huge dimensions in config.json are refused by the weights' header, not after
    allocating them (d_model 65536 x 256 ids would be tens of GiB)."""
    import resource

    d = save_checkpoint(HylaLM(preset("debug")), tmp_path / "ck")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(conf | {"d_model": 65536, "ffn_dim": 262144}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as e:
        load_checkpoint(d)
    assert "\n" not in str(e.value) and "model.safetensors" in str(e.value)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024, grown_kib


def test_a_checkpoint_from_before_dcp_resumes_in_one_process(tmp_path):
    import torch

    out = tmp_path / "old"
    old = Trainer(tiny(out, steps=2))
    old.loop.distributed_checkpoints = False          # the one-process format of before
    old.fit(progress=False)
    assert not (out / "ckpt-000002" / "dcp").exists()
    resumed = Trainer(tiny(out), resume=str(out))
    assert resumed.step == 2 and resumed.fit(progress=False)["step"] == 4
    assert (out / "ckpt-000004" / "dcp").is_dir()      # and continues with DCP checkpoints
    state_file = out / "ckpt-000002" / "train_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["data_position"]["world_size"] = 2          # hand-written data parallelism's
    torch.save(state, state_file)
    with pytest.raises(ValueError, match="predates distributed checkpoints.*--init"):
        Trainer(tiny(out), resume=str(out / "ckpt-000002"))
