"""--layers auto:N: the teacher picks which of its layers stay softmax attention."""

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.distill import Distiller
from hyla.train.distill.config import DistillConfig
from hyla.train.distill.layer_ranking import choose_layers, far_attention, induction_scores


def _teacher(layers="AAAAAA"):
    torch.manual_seed(0)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()


def test_scores_have_one_value_a_layer_and_are_probabilities():
    t = _teacher()
    s = induction_scores(t, length=32)
    assert len(s) == 6 and all(0 <= x <= 1 for x in s)
    ids = torch.randint(0, 256, (1, 80))
    f = far_attention(t, ids, None, window=8, sinks=2)
    assert len(f) == 6 and all(0 <= x <= 1 for x in f)
    # a near-uniform attention (weights shrunk) puts most of its mass beyond a short window
    with torch.no_grad():
        for b in t.blocks:
            b.mixer.q_proj.weight.zero_()
    assert min(far_attention(t, ids, None, window=8, sinks=2)) > 0.7


def test_choice_keeps_n_attention_layers_from_both_rankings():
    t = _teacher()
    ids = torch.randint(0, 256, (1, 80))
    pattern = choose_layers(t, "auto:3", (ids, None), window=8, sinks=2)
    assert len(pattern) == 6 and pattern.count("A") == 3 and set(pattern) == {"A", "G"}
    ind = induction_scores(t)
    far = far_attention(t, ids, None, window=8, sinks=2)
    keep = [i for i, c in enumerate(pattern) if c == "A"]
    assert max(range(6), key=lambda i: ind[i]) in keep
    assert max(range(6), key=lambda i: far[i]) in keep
    assert choose_layers(t, "auto:0") == "G" * 6
    assert choose_layers(t, "auto:6") == "A" * 6
    assert choose_layers(t, "GGAGGA") == "GGAGGA"           # a pattern is kept as it is


@pytest.mark.parametrize("spec", ["auto", "auto:", "auto:-1", "auto:7", "auto:x"])
def test_bad_counts_are_named(spec):
    with pytest.raises(ValueError, match="auto:N"):
        choose_layers(_teacher(), spec)


def test_distill_with_auto_layers(tmp_path):
    save_checkpoint(_teacher("AAAA"), tmp_path / "teacher")
    cfg = DistillConfig(teacher=str(tmp_path / "teacher"), layers="auto:1", window=8,
                        stage1_steps=1, stage2_steps=1, seq_len=48, batch_size=1,
                        eval_batches=1, vocab_chunk=40, report_tokens=0,
                        out=str(tmp_path / "s"))
    d = Distiller(cfg)
    assert d.model.cfg.layers.count("A") == 1 and len(d.model.cfg.layers) == 4
    d.fit(progress=False)
    again = Distiller(resume=str(tmp_path / "s"))          # the same choice on resume
    assert again.model.cfg.layers == d.model.cfg.layers


def test_a_probe_shorter_than_the_window_falls_back_to_induction():
    t = _teacher()
    short = (torch.randint(0, 256, (1, 20)), None)
    assert choose_layers(t, "auto:2", short, window=64) == choose_layers(t, "auto:2")
