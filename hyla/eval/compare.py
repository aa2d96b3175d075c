"""Teacher and student side by side: what a distilled (or any other) model kept.

Perplexity and passkey retrieval (:func:`hyla.eval.model_report.model_report`), accuracy on
``lm-eval`` tasks (:func:`skill_scores`, installed tasks by name or local YAML tasks under
``include_path``) and the recall-by-load curve of key-value pairs written as text
(:func:`hyla.eval.recall.text.text_recall`), for two models, with the student's figure over
the teacher's. ``hyla eval compare TEACHER STUDENT`` prints it and writes ``compare.json``.

Example:
    >>> import tempfile
    >>> from hyla.model import HylaLM, preset
    >>> from hyla.model.formats.checkpoint import save_checkpoint
    >>> from hyla.data import ByteTokenizer
    >>> t = save_checkpoint(HylaLM(preset("debug")), tempfile.mkdtemp(), ByteTokenizer())
    >>> r = compare_models(t, t, recall_pairs=(2,), recall_limit=2)  # doctest: +SKIP
    >>> r["perplexity_ratio"]["512"], len(r["recall"])  # doctest: +SKIP
    (1.0, 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

# the score a task is compared by: the first of these it reports
PRIMARY = ("acc", "exact_match", "acc_norm", "f1", "bleu")


def skill_scores(model, tokenizer, tasks: list[str], *, include_path: str | None = None,
                 limit: int | None = None) -> dict[str, dict]:
    """``lm-eval`` scores of a model in memory on ``tasks`` (installed ones by name, local
    YAML tasks under ``include_path``), ``limit`` documents a task (all when None).

    Returns ``{task: {"metric": name, "score": value, <every metric>: value, "samples": n}}``:
    ``metric`` is the task's accuracy (``acc``, else ``exact_match``, ...). A task neither
    installed nor under ``include_path``: ValueError naming it and ``--include-path``. The
    model's train/eval mode is restored.

    Example:
        >>> import tempfile
        >>> from hyla.data import ByteTokenizer
        >>> from hyla.eval.heldout_mc import SAMPLE, make_items, write_task
        >>> from hyla.model import HylaLM, preset
        >>> items = make_items({"a": SAMPLE, "b": SAMPLE.upper()}, items=2)
        >>> task = write_task(items, tempfile.mkdtemp(), name="tiny_mc")
        >>> s = skill_scores(HylaLM(preset("debug")), ByteTokenizer(), ["tiny_mc"],
        ...                  include_path=str(task.parent))
        >>> s["tiny_mc"]["metric"], s["tiny_mc"]["samples"], 0 <= s["tiny_mc"]["score"] <= 1
        ('acc', 2, True)
    """
    from hyla.eval.harness import run_harness

    tasks = list(tasks)
    was_training = model.training
    try:
        results = run_harness(model, tasks, tokenizer=tokenizer, include_path=include_path,
                              limit=limit)
    finally:
        model.train(was_training)
    samples = results.get("n-samples", {})
    out = {}
    for task in tasks:
        raw = results["results"].get(task) or results.get("groups", {}).get(task, {})
        metrics = {k.split(",")[0]: float(v) for k, v in raw.items()
                   if "," in k and "_stderr" not in k and isinstance(v, int | float)}
        metric = next((m for m in PRIMARY if m in metrics), next(iter(metrics), None))
        n = samples.get(task, {})
        out[task] = {"metric": metric, "score": metrics.get(metric), **metrics,
                     "samples": int(n.get("effective", n.get("original", 0)) or 0)}
    return out


def _ratio(student: float | None, teacher: float | None) -> float | None:
    if student is None or teacher is None or teacher == 0:
        return None
    return student / teacher


def _load(src):
    """(model, tokenizer, name) of a source, or of a (model, tokenizer) pair."""
    from hyla.model.load import load_model, model_name, require_tokenizer

    if isinstance(src, tuple):
        model, tok = src
        return model, tok, getattr(model, "name", None) or "model"
    model, tok = load_model(src)
    return model, require_tokenizer(tok, src, "hyla eval compare"), model_name(src)


def compare_models(teacher_src, student_src, *, tasks: Sequence[str] = (),
                   include_path: str | None = None, limit: int | None = None,
                   recall_pairs: Sequence[int] | None = None, recall_limit: int = 16,
                   ppl_tokens: int = 4096, full: bool = False, data=None,
                   generation: bool = False,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Teacher and student side by side; writes nothing.

    ``teacher_src``/``student_src``: :func:`~hyla.model.load_model` sources (or
    ``(model, tokenizer)`` pairs). Measured on both: held-out perplexity at 512 and 2,048
    tokens on ``data`` (``ppl_tokens`` tokens; default text: the stdlib validation split)
    and passkey retrieval (2 trials a length; 8 and 16K tokens with ``full``), accuracy on
    ``tasks`` (``limit`` documents each), and the recall-by-load curve at ``recall_pairs``
    (``recall_limit`` questions a load, growing context) when given; with ``generation``,
    what each writes greedily (:func:`hyla.eval.generation.generation_eval`, ``limit``
    items a kind).

    Returns ``{"teacher": {...}, "student": {...}, "perplexity_ratio": {len: s/t},
    "skills": [{"task", "metric", "teacher", "student", "ratio"}], "recall":
    [{"num_kv_pairs", "teacher", "student", "ratio"}], "seconds": {...}}``; each model's
    entry holds its name, its ``model_report``, skills and recall records.
    """
    from hyla.eval.model_report import model_report
    from hyla.eval.recall.text import text_recall
    from hyla.model.load import resolve_source

    tasks = list(tasks)
    if recall_pairs is not None:
        recall_pairs = list(recall_pairs)
        if not recall_pairs or any(not isinstance(p, int) or p < 1 for p in recall_pairs):
            raise ValueError(f"recall pairs must be positive ints, got {recall_pairs}")
    if tasks:
        from hyla.eval.harness import task_manager

        task_manager(tasks, include_path)      # an unknown task fails before any load
    for label, src in (("teacher", teacher_src), ("student", student_src)):
        if not isinstance(src, tuple):
            try:
                resolve_source(src)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
    say = progress or (lambda _line: None)
    sides: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    for label, src in (("teacher", teacher_src), ("student", student_src)):
        t0 = time.perf_counter()
        model, tok, name = _load(src)
        seconds[f"{label}_load"] = time.perf_counter() - t0
        say(f"{label} {name}: loaded in {seconds[f'{label}_load']:.1f} s")
        t0 = time.perf_counter()
        report = model_report(model, tok, data=data, tokens=16384 if full else ppl_tokens,
                              trials=8 if full else 2)
        seconds[f"{label}_report"] = time.perf_counter() - t0
        say(f"{label}: perplexity and passkey in {seconds[f'{label}_report']:.1f} s")
        side = {"name": name, "layers": model.cfg.layers, "report": report}
        if tasks:
            t0 = time.perf_counter()
            side["skills"] = skill_scores(model, tok, tasks, include_path=include_path,
                                          limit=limit)
            seconds[f"{label}_skills"] = time.perf_counter() - t0
            say(f"{label}: {len(tasks)} task(s) in {seconds[f'{label}_skills']:.1f} s")
        if recall_pairs:
            t0 = time.perf_counter()
            side["recall"] = text_recall(model, tok, recall_pairs, contexts=("growing",),
                                         limit=recall_limit, name=f"{label} {name}")
            seconds[f"{label}_recall"] = time.perf_counter() - t0
            say(f"{label}: recall at {len(recall_pairs)} load(s) in "
                f"{seconds[f'{label}_recall']:.1f} s")
        if generation:
            from hyla.eval.generation import generation_eval

            t0 = time.perf_counter()
            side["generation"] = generation_eval(model, tok, limit=limit)
            seconds[f"{label}_generation"] = time.perf_counter() - t0
            say(f"{label}: {side['generation']['items']} generated answers in "
                f"{seconds[f'{label}_generation']:.1f} s")
        sides[label] = side
        del model
    teacher, student = sides["teacher"], sides["student"]
    ppl = {n: _ratio(student["report"]["perplexity"][n]["perplexity"],
                     teacher["report"]["perplexity"][n]["perplexity"])
           for n in teacher["report"]["perplexity"]}
    skills = []
    for task in tasks:
        t, s = teacher["skills"][task], student["skills"][task]
        skills.append({"task": task, "metric": t["metric"], "teacher": t["score"],
                       "student": s["score"], "ratio": _ratio(s["score"], t["score"]),
                       "samples": t["samples"]})
    recall = []
    for t, s in zip(teacher.get("recall", []), student.get("recall", []), strict=True):
        recall.append({"num_kv_pairs": t["num_kv_pairs"], "teacher": t["accuracy"],
                       "student": s["accuracy"], "ratio": _ratio(s["accuracy"], t["accuracy"]),
                       "queries": t["queries"]})
    made = []
    if generation:
        t, s = teacher["generation"], student["generation"]
        for kind in ("all", *t["by_kind"]):
            a = t["score"] if kind == "all" else t["by_kind"][kind]
            b = s["score"] if kind == "all" else s["by_kind"][kind]
            made.append({"kind": kind, "teacher": a, "student": b, "ratio": _ratio(b, a),
                         "items": t["items"] if kind == "all" else sum(
                             r["kind"] == kind for r in t["results"])})
    return {"teacher": teacher, "student": student, "perplexity_ratio": ppl,
            "skills": skills, "recall": recall, "generation": made, "tasks": tasks, "limit": limit,
            "include_path": include_path, "full": full, "ppl_tokens": ppl_tokens,
            "seconds": {k: round(v, 1) for k, v in seconds.items()}}
