"""MQAR: generator invariants, constraint errors, and a seconds-long end-to-end recall run."""

import dataclasses
import json

import pytest
import torch

from hyla.cli import main
from hyla.eval import recall as recall_mod
from hyla.eval.mqar import IGNORE, check_mqar_args, mqar
from hyla.eval.recall.models import ShortConvLM, build_model
from hyla.eval.recall.synthetic import RecallPreset, best_records, recall_preset, run_recall
from hyla.model import HylaLM
from hyla.model.config import preset

SHAPES = [(16, 1, 32), (64, 4, 128), (64, 16, 65), (256, 64, 8192), (130, 7, 200)]


@pytest.mark.parametrize("seq_len,pairs,vocab", SHAPES,
                         ids=[f"T{t}-P{p}-V{v}" for t, p, v in SHAPES])
def test_generator_invariants(seq_len, pairs, vocab):
    b = mqar(32, seq_len, pairs, vocab, seed=3)
    x, y = b.inputs, b.labels
    assert x.shape == y.shape == (32, seq_len) and x.dtype == y.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < vocab
    half = vocab // 2
    keys, values = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
    assert bool(((keys >= 1) & (keys < half)).all()) and bool((values >= half).all())
    for row in range(32):
        assert len(set(keys[row].tolist())) == pairs == len(set(values[row].tolist()))
        pos = (y[row] != IGNORE).nonzero().flatten()
        assert len(pos) == pairs  # one query per key
        assert bool((pos >= 2 * pairs).all()) and bool(((pos - 2 * pairs) % 2 == 0).all())
        table = dict(zip(keys[row].tolist(), values[row].tolist(), strict=True))
        queried = x[row, pos].tolist()
        assert sorted(queried) == sorted(table)  # every key asked exactly once
        assert y[row, pos].tolist() == [table[k] for k in queried]  # label = paired value
    assert bool((y[:, :2 * pairs] == IGNORE).all())


def test_generator_is_seeded_and_gaps_favour_short():
    a, b = mqar(8, 128, 8, 256, seed=1), mqar(8, 128, 8, 256, seed=1)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, mqar(8, 128, 8, 256, seed=2).inputs)
    pos = (mqar(2000, 128, 4, 256, seed=0).labels != IGNORE).nonzero()[:, 1]
    gaps = (pos - 8) // 2  # power law with a = 0.01: short gaps far more likely
    assert (gaps < 10).float().mean() > 0.4 > (gaps >= 50).float().mean()


@pytest.mark.parametrize("args,name", [
    ((64, 64, 4), "vocab_size"), ((32, 64, 4), "vocab_size"), ((8192, 64, 17), "num_kv_pairs"),
    ((8192, 63, 4), "seq_len"), ((8192, 0, 4), "seq_len"), ((8192, 64, 0), "num_kv_pairs"),
], ids=["vocab-eq", "vocab-small", "pairs", "odd", "zero-len", "zero-pairs"])
def test_constraint_errors_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        check_mqar_args(*args)
    with pytest.raises(ValueError, match=name):
        mqar(2, args[1], args[2], args[0])


def test_preset_validation():
    assert recall_preset("zoology").test[-1] == (1024, 256)
    with pytest.raises(ValueError, match="unknown recall preset"):
        recall_preset("nope")
    with pytest.raises(ValueError, match="num_kv_pairs"):
        RecallPreset(name="x", vocab_size=512, d_model=32, train=((64, 32),), test=((64, 4),))
    with pytest.raises(ValueError, match="mixers"):
        RecallPreset(name="x", vocab_size=512, d_model=32, train=((64, 4),), test=((64, 4),),
                     mixers=("GX",))


def test_short_conv_model_is_causal():
    torch.manual_seed(0)
    m = build_model(preset("debug"), short_conv=4)
    assert isinstance(m, ShortConvLM) and isinstance(build_model(preset("debug")), HylaLM)
    ids = torch.randint(0, 256, (1, 20))
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 256
    a, b = m(ids), m(changed)
    assert torch.allclose(a[0, :12], b[0, :12], atol=1e-6)
    assert not torch.allclose(a[0, 12:], b[0, 12:])


TINY = RecallPreset(name="tiny", vocab_size=80, d_model=32, n_heads=2, chunk_size=16,
                    train=((32, 4), (32, 8)), test=((32, 4), (48, 8), (64, 16)),
                    lrs=(1e-3, 3e-3), train_steps=3, batch_size=4, test_examples=8)


def test_run_recall_records():
    records = run_recall(TINY, seed=5)
    assert len(records) == 3 * 2 * 3
    best = best_records(records)
    assert sorted({r["mixer"] for r in best}) == ["AA", "GA", "GG"] and len(best) == 9
    for r in records:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["seed"] == 5 and r["train_steps"] == 3
        assert r["params"] > 0 and r["d_model"] == 32 and r["lr"] in TINY.lrs
    state = {(r["mixer"], r["seq_len"]): r["state_bytes"] for r in best}
    # GLA state does not grow with the context; attention keys and values do.
    assert state["GG", 32] == state["GG", 64] < state["AA", 32] < state["AA", 64]



def test_parallel_sweep_matches_serial():
    """jobs=2 trains in two spawned one-thread processes: same records as one thread here."""
    tiny = dataclasses.replace(TINY, mixers=("GG", "AA"), lrs=(3e-3,))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = run_recall(tiny, seed=2)
    finally:
        torch.set_num_threads(before)
    parallel = run_recall(tiny, seed=2, jobs=2)
    strip = [{k: v for k, v in r.items() if "seconds" not in k} for r in serial]
    assert strip == [{k: v for k, v in r.items() if "seconds" not in k} for r in parallel]

def test_cli_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(recall_mod.PRESETS, "quick", lambda: TINY)
    code = main(["eval", "recall", "--preset", "quick", "--out", str(tmp_path), "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    records = json.loads((tmp_path / "results.json").read_text())
    keys = {"mixer", "seq_len", "num_kv_pairs", "accuracy", "state_bytes", "lr", "seed",
            "d_model", "params", "train_steps"}
    assert records and all(keys <= set(r) for r in records)
    for name in ("accuracy_vs_pairs.png", "accuracy_vs_state.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "MQAR recall" in out and json.loads((tmp_path / "run.json").read_text())["seed"] == 1


def test_quick_has_delta_rule_models_and_they_train():
    quick = recall_preset("quick")
    assert quick.mixers == ("GG", "GA", "AA", "DD", "DA", "KK")
    # What made GLA learn (issue 33): zero filler, slow initial gates, one lr, a curriculum.
    assert not quick.random_filler and quick.gate_logit_normalizer == 256.0
    assert quick.lrs == (1e-3,) and quick.shapes_at(0) == ((64, 4), (64, 8))
    tiny = dataclasses.replace(TINY, mixers=("DD", "DA"), lrs=(1e-3,))
    best = best_records(run_recall(tiny, seed=2))
    assert {r["mixer"] for r in best} == {"DD", "DA"}
    state = {(r["mixer"], r["seq_len"]): r["state_bytes"] for r in best}
    assert state["DD", 32] == state["DD", 64] < state["DA", 32] < state["DA", 64]


def test_zero_filler_keeps_pairs_and_queries():
    a = mqar(16, 64, 6, 128, seed=4)
    b = mqar(16, 64, 6, 128, seed=4, random_filler=False)
    assert torch.equal(a.labels, b.labels)
    keep = torch.zeros_like(a.inputs, dtype=torch.bool)
    keep[:, :12] = True
    keep |= a.labels != IGNORE
    assert torch.equal(a.inputs[keep], b.inputs[keep])
    assert bool((b.inputs[~keep] == 0).all()) and bool((a.inputs[~keep] != 0).any())


def test_curriculum_and_per_mixer_lrs():
    p = dataclasses.replace(TINY, train_steps=10, curriculum=((0.3, ((32, 2),)),
                                                               (0.6, ((32, 4), (48, 8)))),
                            mixer_lrs=(("AA", (3e-3,)),))
    assert [p.shapes_at(s) for s in (0, 2, 3, 5, 6, 9)] == [
        ((32, 2),), ((32, 2),), ((32, 4), (48, 8)), ((32, 4), (48, 8)), TINY.train, TINY.train]
    assert p.lrs_for("AA") == (3e-3,) and p.lrs_for("GG") == TINY.lrs
    records = run_recall(dataclasses.replace(p, mixers=("AA",), train_steps=2), seed=0)
    assert {r["lr"] for r in records} == {3e-3}
    for bad in (((1.5, ((32, 2),)),), ((0.5, ((32, 2),)), (0.2, ((32, 2),))), ((0.5, ()),)):
        with pytest.raises(ValueError, match="curriculum"):
            dataclasses.replace(TINY, curriculum=bad)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        dataclasses.replace(TINY, curriculum=((0.5, ((32, 9),)),))
