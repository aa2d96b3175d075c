"""--layers auto:N --layer-ranking kl: layers ranked by the vocabulary KL they remove."""

import dataclasses
import math

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.train.distill.kl_ranking import kl_layer_scores, linear_student, restored_kl
from hyla.train.distill.layer_ranking import choose_layers, far_attention, induction_scores


def _teacher(layers="AAA"):
    torch.manual_seed(0)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()


def _text(T=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (1, T), generator=g), None)


def test_scores_one_a_layer_finite_and_teacher_untouched():
    t = _teacher()
    before = {k: v.clone() for k, v in t.state_dict().items()}
    mixers = [b.mixer for b in t.blocks]
    base, restored = restored_kl(t, [_text(), _text(seed=2)], window=4, sinks=1)
    assert base > 1e-4 and len(restored) == 3
    assert all(math.isfinite(r) and r >= 0 for r in restored)
    # the teacher's log-probabilities recomputed chunk by chunk (no cache) give the same KL
    b2, r2 = restored_kl(t, [_text(), _text(seed=2)], window=4, sinks=1, chunk=7,
                         cache_bytes=0)
    assert [b2, *r2] == pytest.approx([base, *restored], rel=1e-5, abs=1e-7)
    scores = kl_layer_scores(t, [_text(), _text(seed=2)], window=4, sinks=1)
    assert scores == pytest.approx([base - r for r in restored], rel=1e-5, abs=1e-7)
    assert [b.mixer for b in t.blocks] == mixers              # swapped back, not copied
    assert all(torch.equal(v, t.state_dict()[k]) for k, v in before.items())


def test_a_one_layer_teacher_restored_is_the_teacher():
    t = _teacher("A")
    base, restored = restored_kl(t, [_text()], window=4, sinks=1)
    assert base > 1e-4 and restored[0] == pytest.approx(0.0, abs=1e-6)


def test_a_layer_whose_output_is_zero_removes_no_kl():
    # Layer 1's output projection is zero in the teacher, so its windowed student copy is
    # exact (also zero) and restoring it removes nothing; layer 0 is the one that matters,
    # though its attention patterns are the same kind as layer 1's.
    t = _teacher("AA")
    with torch.no_grad():
        t.blocks[1].mixer.o_proj.weight.zero_()
    probe = _text()
    scores = kl_layer_scores(t, [probe], window=4, sinks=1)
    assert scores[1] == pytest.approx(0.0, abs=1e-6) and scores[0] > 1e-4
    assert choose_layers(t, "auto:1", probe, window=4, sinks=1, ranking="kl") == "AG"
    # the probes see only attention patterns: they cannot tell the zeroed layer is inert
    probes = [induction_scores(t), far_attention(t, *probe, window=4, sinks=1)]
    assert any(s[1] > s[0] for s in probes)


def test_the_calibrated_student_is_all_linear_and_calibrated():
    t = _teacher()
    s = linear_student(t, _text(), window=4, sinks=1)
    assert s.cfg.layers == "GGG" and s.cfg.linear_window == 4
    fresh = linear_student(t, _text(), window=4, sinks=1)
    uncal = type(s)(s.cfg)
    assert torch.equal(fresh.blocks[0].mixer.mix_proj.bias, s.blocks[0].mixer.mix_proj.bias)
    assert not torch.equal(uncal.blocks[0].mixer.mix_proj.bias, s.blocks[0].mixer.mix_proj.bias)


def test_choose_layers_kl_gives_a_valid_pattern_and_bad_input_is_named():
    t = _teacher("AAAA")
    probe = _text(48)
    p = choose_layers(t, "auto:1", probe, window=4, sinks=1, ranking="kl")
    assert len(p) == 4 and p.count("A") == 1 and set(p) == {"A", "G"}
    scores = kl_layer_scores(t, [probe], window=4, sinks=1)
    assert p.index("A") == max(range(4), key=lambda i: scores[i])
    assert choose_layers(t, "auto:2", probe, window=4, sinks=1, ranking="kl",
                         linear="G").count("A") == 2
    # the default ranking is unchanged by the new keywords
    assert (choose_layers(t, "auto:2", probe, window=4, sinks=1) ==
            choose_layers(t, "auto:2", probe, window=4, sinks=1, ranking="probes"))
    with pytest.raises(ValueError, match="ranking.*'klx'"):
        choose_layers(t, "auto:1", probe, ranking="klx")
    with pytest.raises(ValueError, match="probe"):
        choose_layers(t, "auto:1", ranking="kl")
    with pytest.raises(ValueError, match="auto:N"):
        choose_layers(t, "auto:9", probe, ranking="kl")


def test_the_linear_letter_is_the_students_and_the_patterns():
    # windowed gated-delta students (D) rank the same way, and the pattern uses the letter
    t = _teacher()
    probe = _text(48)
    base, restored = restored_kl(t, [probe], window=4, sinks=1, linear="D")
    assert base > 1e-4 and all(math.isfinite(r) for r in restored)
    p = choose_layers(t, "auto:1", probe, window=4, sinks=1, ranking="kl", linear="D")
    assert sorted(p) == ["A", "D", "D"]
