"""``hyla eval compare`` and hyla.eval.compare: a debug teacher and student side by side on a
tiny local multiple-choice task (made by hyla.eval.heldout_mc), perplexity, passkey and the
recall-by-load curve; skill_scores on a model object agrees with the harness on its checkpoint;
bad input fails clearly."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("lm_eval")

from hyla.cli.main import main  # noqa: E402
from hyla.data import ByteTokenizer  # noqa: E402
from hyla.eval.compare import skill_scores  # noqa: E402
from hyla.eval.harness import run_harness, task_manager  # noqa: E402
from hyla.eval.heldout_mc import SAMPLE, make_items, write_task  # noqa: E402
from hyla.model import HylaLM, preset  # noqa: E402
from hyla.model.formats.checkpoint import save_checkpoint  # noqa: E402
from hyla.model.load import load_model  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    paths = []
    for seed, layers in ((0, "GGAA"), (1, "GGGA")):
        torch.manual_seed(seed)
        model = HylaLM(dataclasses.replace(preset("debug"), layers=layers))
        paths.append(save_checkpoint(model, tmp / f"m{seed}", ByteTokenizer()))
    items = make_items({"a": SAMPLE, "b": SAMPLE.upper()}, items=6, seed=0)
    task = write_task(items, tmp / "tasks", name="tiny_mc")
    return tmp, paths[0], paths[1], task.parent


def test_skill_scores_of_a_model_object_match_the_harness_on_its_checkpoint(work):
    _, teacher, _, tasks = work
    model, tok = load_model(str(teacher))
    model.train()
    scores = skill_scores(model, tok, ["tiny_mc"], include_path=str(tasks))
    assert model.training                               # the caller's mode is kept
    by_path = run_harness(str(teacher), ["tiny_mc"], include_path=str(tasks))
    s = scores["tiny_mc"]
    assert s["metric"] == "acc" and s["samples"] == 6
    assert s["score"] == pytest.approx(by_path["results"]["tiny_mc"]["acc,none"])
    assert s["acc_norm"] == pytest.approx(by_path["results"]["tiny_mc"]["acc_norm,none"])


def test_compare_cli_table_json_and_recall_plot(work, capsys):
    tmp, teacher, student, tasks = work
    out = tmp / "out"
    assert main(["eval", "compare", str(teacher), str(student), "--tasks", "tiny_mc",
                 "--include-path", str(tasks), "--limit", "5", "--recall-pairs", "2,4",
                 "--recall-limit", "2", "--ppl-tokens", "512", "--out", str(out),
                 "--threads", "1"]) == 0
    r = json.loads((out / "compare.json").read_text())
    assert r["teacher"]["layers"] == "GGAA" and r["student"]["layers"] == "GGGA"
    (skill,) = r["skills"]
    assert skill["task"] == "tiny_mc" and skill["samples"] == 5
    assert skill["teacher"] == r["teacher"]["skills"]["tiny_mc"]["acc"]
    if skill["teacher"]:
        assert skill["ratio"] == pytest.approx(skill["student"] / skill["teacher"])
    assert [x["num_kv_pairs"] for x in r["recall"]] == [2, 4]
    assert [x["accuracy"] for x in r["student"]["recall"]] == [x["student"]
                                                                for x in r["recall"]]
    ppl = r["student"]["report"]["perplexity"]["512"]["perplexity"] / \
        r["teacher"]["report"]["perplexity"]["512"]["perplexity"]
    assert r["perplexity_ratio"]["512"] == pytest.approx(ppl)
    assert r["student"]["report"]["state_bytes_8k"] < r["teacher"]["report"]["state_bytes_8k"]
    assert (out / "accuracy_vs_pairs.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "tiny_mc (acc, 5 docs)" in text and "recall at 4 pairs" in text


@pytest.mark.parametrize("extra, needle", [
    (["--recall-pairs", "2,x"], "--recall-pairs must be comma-separated positive ints"),
    (["--recall-pairs", "0"], "--recall-pairs"),
    (["--tasks", "tiny_mc", "--include-path", "{tmp}/none"], "no such folder"),
])
def test_compare_bad_input(work, capsys, extra, needle):
    tmp, teacher, student, _ = work
    extra = [a.replace("{tmp}", str(tmp)) for a in extra]
    assert main(["eval", "compare", str(teacher), str(student), *extra,
                 "--out", str(tmp / "bad")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp / "bad" / "compare.json").exists()


def test_compare_missing_model_is_named(work, capsys):
    tmp, teacher, _, _ = work
    assert main(["eval", "compare", str(teacher), str(tmp / "nope"), "--out",
                 str(tmp / "bad")]) == 2
    err = capsys.readouterr().err
    assert "student" in err and "not found" in err


def test_an_unknown_task_names_itself_and_include_path(work):
    """lm-eval's whole index is read to be sure (seconds): one test of it."""
    _, _, _, tasks = work
    with pytest.raises(ValueError, match=r"no_such_task_35.*--include-path"):
        task_manager(["tiny_mc", "no_such_task_35"], str(tasks))


def test_compare_generation_rows(work, capsys):
    """--generation: both models' greedy answers scored, --limit items a kind, a row a
    kind with the student's share over the teacher's."""
    tmp, teacher, student, _ = work
    out = tmp / "gen"
    assert main(["eval", "compare", str(teacher), str(student), "--generation", "--limit", "1",
                 "--ppl-tokens", "256", "--out", str(out), "--threads", "1"]) == 0
    r = json.loads((out / "compare.json").read_text())
    assert [g["kind"] for g in r["generation"]] == ["all", "python", "recall", "qa"]
    assert r["generation"][0]["items"] == 3 == r["student"]["generation"]["items"]
    assert r["generation"][1]["student"] == r["student"]["generation"]["by_kind"]["python"]
    assert "generation, all (3 items, greedy)" in capsys.readouterr().out
