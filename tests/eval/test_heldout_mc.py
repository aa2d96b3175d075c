"""The held-out multiple-choice task generator (hyla.eval.heldout_mc, ``hyla eval make-mc``):
items from a tiny embedded text, deterministic by seed, gold = the true continuation,
distractors of similar length from other paragraphs, a task lm-eval loads."""

import json
import sysconfig

import pytest

from hyla.cli.main import main
from hyla.eval.heldout_mc import make_items, man_prose, passages, write_task

PROSE = """
A compiler reads the source text of a program and translates it into instructions that a
machine can run. It checks the text for errors before it writes any output. Most compilers
also try to make the program faster.

The kernel decides which process runs on each processor and for how long it may run before
another one gets a turn. A process that waits for input gives up its turn at once. Such a
process is said to be blocked.

A file system keeps the names of files in directories, and each directory may hold other
directories as well as files. The top of this tree is called the root. Every file can be
reached by a path that starts there.

When a network packet arrives, the card copies it into memory and tells the processor that
new data is waiting to be read. The driver then hands the packet to the protocol code.
Packets that are damaged are thrown away.

A shell reads commands typed by the user and starts the programs that those commands name,
one after another. It also expands patterns such as a star into lists of file names. Scripts
are files full of such commands.

Version control records every change made to a set of files, so that any earlier state can
be brought back when it is needed. Each change carries a message written by its author.
Branches let several lines of work proceed side by side.

A database stores records in tables and answers questions about them that are written in a
query language such as SQL. Indexes make those answers arrive much sooner. Without an index
every row must be read.

Memory that a program no longer needs should be given back, or the program will slowly use
more and more of the machine until it fails. Some languages do this automatically. Others
leave the task to the programmer.

{ this = is + code; } with $symbols | and <brackets> that should never be taken as prose at all
because it is clearly not prose, no matter how many words it has in it.

COPYRIGHT
"""


def _docs():
    paras = [p for p in PROSE.split("\n\n") if p.strip()]
    return {"a": "\n\n".join(paras[:4]), "b": "\n\n".join(paras[4:])}


def test_items_are_true_continuations_with_similar_distractors():
    docs = _docs()
    assert len(passages(PROSE)) == 8                    # the code paragraph is left out
    items = make_items(docs, items=6, seed=0)
    flat = " ".join(PROSE.split())
    assert len(items) == 6 and {i["source"] for i in items} == {"a", "b"}
    for item in items:
        gold = item["choices"][item["answer"]]
        assert f"{item['context']} {gold}" in flat       # the true continuation
        assert len(set(item["choices"])) == 4 and item["context"].split()[0][0].isupper()
        for wrong in item["choices"]:
            if wrong != gold:                            # another paragraph's next sentence
                assert f"{item['context']} {wrong}" not in flat and wrong in flat
    assert {i["answer"] for i in make_items(docs, items=8, seed=1)} != {0}  # gold is shuffled


def test_deterministic_by_seed_and_too_few_paragraphs_is_an_error(tmp_path):
    docs = _docs()
    assert make_items(docs, items=5, seed=3) == make_items(docs, items=5, seed=3)
    assert make_items(docs, items=5, seed=3) != make_items(docs, items=5, seed=4)
    with pytest.raises(ValueError, match="fewer than the 80 items"):
        make_items(docs, items=80)


def test_man_prose_keeps_the_body_and_drops_licences_and_synopsis():
    page = ("LS(1)    User Commands    LS(1)\n\nNAME\n       ls - list\n\nSYNOPSIS\n"
            "       ls [OPTION]... [FILE]...\n\nDESCRIPTION\n       List information.\n\n"
            "COPYRIGHT\n       Copyright 2022 Free Software Foundation.\n")
    text = man_prose(page)
    assert "List information." in text
    assert "Copyright" not in text and "OPTION" not in text and "ls - list" not in text


def test_make_mc_cli_writes_a_task_lm_eval_loads(tmp_path, capsys):
    lm_eval = pytest.importorskip("lm_eval.tasks")
    src = tmp_path / "prose.txt"
    src.write_text(PROSE)
    out = tmp_path / "task"
    assert main(["eval", "make-mc", str(src), "--out", str(out), "--items", "7",
                 "--seed", "2", "--name", "tiny_mc"]) == 0
    rows = [json.loads(line) for line in open(out / "tiny_mc.jsonl")]
    meta = json.loads((out / "tiny_mc.meta.json").read_text())
    assert len(rows) == meta["items"] == 7 and meta["seed"] == 2 and meta["choices"] == 4
    assert rows == make_items({"prose.txt": PROSE}, items=7, seed=2)
    manager = lm_eval.TaskManager(include_path=str(out), include_defaults=False)
    assert "tiny_mc" in manager.all_tasks
    assert "--include-path" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["/no/such/prose"], "no such file"),
    ([sysconfig.get_paths()["stdlib"]], "training data"),
    (["{prose}", "--name", "bad-name"], "task name"),
    (["{prose}", "--items", "500"], "--items"),
])
def test_make_mc_bad_input(tmp_path, capsys, argv, needle):
    (tmp_path / "p.txt").write_text(PROSE)
    argv = [a.replace("{prose}", str(tmp_path / "p.txt")) for a in argv]
    assert main(["eval", "make-mc", *argv, "--out", str(tmp_path / "o")]) == 2
    assert needle in capsys.readouterr().err


def test_write_task_keeps_braces_literal(tmp_path):
    """Field names, not templates: prose with {{ }} reaches the model as written."""
    lm_eval = pytest.importorskip("lm_eval.tasks")
    items = [{"context": "Write {{x}} here.", "choices": ["a {b}", "c", "d", "e"],
              "answer": 0, "source": "s"}]
    write_task(items, tmp_path, name="braces")
    task = lm_eval.TaskManager(include_path=str(tmp_path), include_defaults=False
                               ).load(["braces"])["tasks"]["braces"]
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == "Write {{x}} here." and task.doc_to_choice(doc)[0] == "a {b}"


def test_a_real_manual_page_renders_to_prose_paragraphs():
    """The benchmark's source, where this machine has man and its own page (else skipped)."""
    from hyla.eval.heldout_mc import render_man

    try:
        text = man_prose(render_man("man"))
    except ValueError as e:
        pytest.skip(f"no man page here: {e}")
    paras = passages(text)
    assert len(paras) >= 3
    assert all("\n" not in " ".join(p) and len(p) >= 2 for p in paras)   # one paragraph a line
    assert "MAN(1)" not in text                     # the page header is left out
