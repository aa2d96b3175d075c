"""``hyla eval generate``: items scored by what is written (tests run in a bounded child
process), the CLI end to end on a tiny model, and bad input or runaway code named."""

from __future__ import annotations

import json
import time

import pytest

from hyla.cli import main
from hyla.data import ByteTokenizer
from hyla.eval import writing_tasks as items
from hyla.eval.generation import _cases, fenced_code, function_body, generation_eval, score
from hyla.eval.sandbox import Limits, run_python
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint

ANSWERS = {"add": "    return a + b\n", "is_even": "    return n % 2 == 0\n",
           "reverse_string": "    return s[::-1]\n",
           "count_vowels": "    return sum(c in 'aeiouAEIOU' for c in text)\n",
           "factorial": "    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\n",
           "largest": "    return max(numbers)\n",
           "fizzbuzz": "    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n"
                       "        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
                       "    return str(n)\n",
           "is_palindrome": "    return s == s[::-1]\n",
           "sum_of_squares": "    return sum(i * i for i in range(1, n + 1))\n",
           "to_fahrenheit": "    return celsius * 9 / 5 + 32\n",
           "unique_sorted": "    return sorted(set(items))\n",
           "word_count": "    return len(text.split())\n"}


def test_every_python_item_has_an_answer_that_passes_and_a_wrong_one_that_fails():
    cases = [c for c in _cases(("python",)) if c["kind"] == "python"]
    assert len(cases) == len(items.PYTHON) == len(ANSWERS)
    for case in cases:
        name = case["id"].split("/")[1]
        # trailing text after the function (a model rambling on) is cut, not run
        ok, note = score(case, ANSWERS[name] + "\nprint(undefined_name)\n")
        assert ok, (name, note)
        assert not score(case, "    return None\n")[0], name


def test_answers_are_judged_on_their_first_line():
    recall = next(c for c in _cases(("recall",)) if c["id"] == "recall/keeper")
    assert score(recall, " Orlan Vesk keeps it.\nQ: and more")[0]
    assert not score(recall, " Nobody.\nOrlan")[0]           # the reference on line 2
    upper = next(c for c in _cases(("qa",)) if c["id"] == "qa/upper")
    assert score(upper, " APPLE")[0] and not score(upper, " apple")[0]     # case-sensitive
    assert function_body("    x = 1\n\n    return x\ndef g():\n") == "    x = 1\n\n    return x\n"


@pytest.mark.parametrize("program,why", [
    ("while True:\n    pass\n", "timed out|signal"),
    ("while True:\n    print('x' * 1000)\n", "MB limit"),  # output capped by size
    ("x = bytearray(4 * 1024 ** 3)\n", "MemoryError"),
    ("import sys\nsys.exit(3)\n", ""),
])
def test_runaway_programs_are_stopped_and_named(program, why):
    began = time.perf_counter()
    ok, note = run_python(program, Limits(wall_s=5, cpu_s=2, memory_mb=512))
    assert not ok and time.perf_counter() - began < 8
    assert not why or any(w in note for w in why.split("|")), note
    assert len(note) < 5000


def test_generation_eval_on_a_tiny_model_and_the_cli(tmp_path, capsys):
    model = HylaLM(preset("debug")).eval()
    r = generation_eval(model, ByteTokenizer(), kinds=("python", "qa"), limit=1,
                        max_new_tokens=6)
    assert r["items"] == 2 and set(r["by_kind"]) == {"python", "qa"}
    assert {x["id"] for x in r["results"]} == {"python/add", "qa/plus"}
    path = save_checkpoint(model, tmp_path / "m", ByteTokenizer())
    assert main(["eval", "generate", "--checkpoint", str(path), "--kinds", "recall",
                 "--limit", "1", "--threads", "1", "--out", str(tmp_path / "g.json")]) == 0
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["items"] == 1 and saved["results"][0]["kind"] == "recall"
    capsys.readouterr()
    assert main(["eval", "generate", "--checkpoint", str(path), "--kinds", "poetry"]) == 2
    assert main(["eval", "generate", "--checkpoint", str(path), "--threads", "0"]) == 2
    assert "--kinds 'poetry': choose from python, recall, qa" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        generation_eval(model, ByteTokenizer(), limit=0)


def test_chat_answers_are_read_from_their_code_block():
    """A model with a chat template is asked in one user message; its answer's code block
    is run, whole function or body alone."""
    (case,) = [c for c in _cases(("python",), chat=True) if c["id"] == "python/add"]
    assert "```python\ndef add(a, b):" in case["prompt"]
    whole = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nEnjoy."
    assert score(case, whole)[0]
    assert score(case, "```python\n    return a + b\n```")[0]          # the body alone
    assert not score(case, "```python\ndef add(a, b):\n    return a - b\n```")[0]
    assert fenced_code("no code here") is None
    (qa,) = [c for c in _cases(("qa",), chat=True) if c["id"] == "qa/plus"]
    assert qa["prompt"] == "What is 15 plus 27? Answer in a few words."
