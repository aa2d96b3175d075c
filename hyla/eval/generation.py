"""Judge a model by what it writes: greedy answers to held-out prompts, scored against
references (:mod:`hyla.eval.writing_tasks`).

Likelihood measures (perplexity, multiple choice) flatter linearised students: a model can
rank the right answer first yet lose its way over a long answer or a format. Here every item
is generated greedily and scored on the text: Python bodies by running their tests
(pass@1, :func:`hyla.eval.sandbox.run_python`), notes and questions by containing the
reference on the answer's first line. A model with a chat template is asked each item as
one user message (its Python answer's code block is run); others get raw prompts with worked
examples. ``hyla eval generate`` scores one model;
``hyla eval compare --generation`` puts teacher and student side by side.

Example:
    >>> from hyla.data import ByteTokenizer
    >>> from hyla.model import HylaLM, preset
    >>> r = generation_eval(HylaLM(preset("debug")).eval(), ByteTokenizer(),
    ...                     kinds=("qa",), limit=2, max_new_tokens=4)
    >>> r["items"], sorted(r["by_kind"]), 0 <= r["score"] <= 1
    (2, ['qa'], True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hyla.data.tokenizer import stop_ids
from hyla.eval import writing_tasks as items
from hyla.eval.sandbox import Limits, run_python

KINDS = ("python", "recall", "qa")
MAX_NEW_TOKENS = {"python": 200, "recall": 32, "qa": 24}


def function_body(text: str) -> str:
    """The completion up to the end of the function it continues: the first non-empty line
    that is not indented ends it.

    Example:
        >>> function_body("    return a + b\\n\\nprint(add(1, 2))\\n")
        '    return a + b\\n\\n'
    """
    kept = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return "".join(kept)


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def fenced_code(text: str) -> str | None:
    """The first fenced code block of ``text`` (its body), or None.

    Example:
        >>> fenced_code("Sure:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
        'def f():\\n    return 1\\n'
    """
    start = text.find("```")
    if start < 0:
        return None
    body = text[start + 3:].split("\n", 1)[1] if "\n" in text[start + 3:] else ""
    return body.split("```", 1)[0]


def _cases(kinds: Sequence[str], chat: bool = False) -> list[dict]:
    """The items as prompts: for a model with a chat template, one user message each
    (instruction-tuned models answer so; a raw prompt lets them close a code block at
    once), else raw text with worked examples before each question."""
    out = []
    for name, prompt, tests in items.PYTHON if "python" in kinds else ():
        out.append({"id": f"python/{name}", "kind": "python", "code": prompt, "tests": tests,
                    "name": name, "prompt": items.CODE_ASK.format(code=prompt) if chat
                    else prompt})
    for name, note, question, refs in items.RECALL if "recall" in kinds else ():
        out.append({"id": f"recall/{name}", "kind": "recall", "refs": refs, "case": False,
                    "prompt": f"{note}\n{question} {items.BRIEF}" if chat else
                    f"{items.RECALL_SHOTS}Note: {note}\nQ: {question}\nA:"})
    for name, question, refs, case in items.QA if "qa" in kinds else ():
        out.append({"id": f"qa/{name}", "kind": "qa", "refs": refs, "case": case,
                    "prompt": f"{question} {items.BRIEF}" if chat else
                    f"{items.QA_SHOTS}Q: {question}\nA:"})
    return out


def python_program(case: dict, text: str) -> str:
    """The program a Python answer makes with the item's tests: the answer's code block
    (or the answer) where it holds the whole function, else the item's signature and
    docstring followed by the answer's body."""
    code = fenced_code(text)
    code = text if code is None else code
    if f"def {case['name']}(" not in code:
        code = case["code"] + function_body(code)
    return code + "\n\n" + case["tests"] + "\n"


def score(case: dict, text: str, limits: Limits | None = None) -> tuple[bool, str]:
    """(whether ``text``, the model's answer to ``case``'s prompt, is right; a note: the
    test run's output for Python, else the answer line)."""
    if case["kind"] == "python":
        return run_python(python_program(case, text), limits or Limits())
    answer = first_line(text)
    if case["case"]:
        return any(r in answer for r in case["refs"]), answer
    return any(r.lower() in answer.lower() for r in case["refs"]), answer


def generation_eval(model, tokenizer, *, kinds: Sequence[str] = KINDS,
                    limit: int | None = None, max_new_tokens: int | None = None,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Greedy answers of ``model`` to the items of ``kinds`` (``limit`` a kind), scored.

    Returns ``{"score": share right over all items, "by_kind": {kind: share}, "items": n,
    "seconds": s, "results": [{"id", "kind", "ok", "output", "note"}]}``.
    ValueError naming an unknown kind.
    """
    from hyla.model.generate import generate

    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds: {unknown or 'none'} given: choose from {', '.join(KINDS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    stops = stop_ids(tokenizer) if chat else ()
    cases = _cases(kinds, chat)
    if limit is not None:
        cases = [c for k in kinds for c in [c for c in cases if c["kind"] == k][:limit]]
    began, results = time.perf_counter(), []
    for case in cases:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": case["prompt"]}]) if chat else case["prompt"])
        n = max_new_tokens or MAX_NEW_TOKENS[case["kind"]]

        def done(new: list[int], kind=case["kind"]) -> bool:
            text = tokenizer.decode(new)
            if kind == "python" and chat:       # a code block opened and closed
                return text.count("```") >= 2
            if kind == "python":     # the function ended: an unindented line began
                return function_body(text) != text.rstrip(" ") and "\n" in text
            return "\n" in text.lstrip()
        text = tokenizer.decode(generate(model, prompt, n, temperature=0.0, until=done,
                                         stop_ids=stops))
        ok, note = score(case, text)
        results.append({"id": case["id"], "kind": case["kind"], "ok": ok, "output": text,
                        "note": note[:300]})
        if progress:
            progress(f"{case['id']}: {'right' if ok else 'wrong'}")
    by_kind = {k: sum(r["ok"] for r in results if r["kind"] == k)
               / max(1, sum(r["kind"] == k for r in results)) for k in kinds}
    return {"score": sum(r["ok"] for r in results) / max(1, len(results)), "by_kind": by_kind,
            "items": len(results), "seconds": time.perf_counter() - began, "results": results}
