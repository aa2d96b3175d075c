"""A held-out multiple-choice task for ``lm-eval``, made from plain English prose.

Each item is one paragraph of the source: the question is its first sentences (at least
``MIN_CONTEXT_WORDS`` words), the gold choice the sentence that follows them, and the three
distractors sentences that follow the opening of other paragraphs, picked among those of
the most similar length (so the length of a choice gives nothing away). A model that reads
the passage can tell its continuation; chance is 1/4. The task is ``lm-eval``'s local
kind: ``NAME.yaml`` (``output_type: multiple_choice``, metrics ``acc`` and ``acc_norm``) and
``NAME.jsonl`` in one folder, run with ``hyla eval harness --include-path DIR --tasks NAME``.

The default source is text that neither distillation (the Python standard library's
source) nor the README's evaluation (its validation split and ``/usr/share/common-licenses``)
reads: the manual pages of :data:`MAN_PAGES` (bash, git, make, ssh, ...: technical English
prose), rendered by ``man`` one paragraph a line. Everything is deterministic given the
source text and ``seed``; the task's ``NAME.meta.json`` keeps a digest of the items.

Example:
    >>> docs = {"a": SAMPLE, "b": SAMPLE.replace("cat", "dog")}
    >>> items = make_items(docs, items=3, seed=0)
    >>> len(items), [len(i["choices"]) for i in items], items == make_items(docs, items=3)
    (3, [4, 4, 4], True)
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sysconfig

# prose-heavy manual pages of common Debian/Ubuntu packages (bash, git, make, openssh,
# gnupg, tar, less, man-db, systemd, dpkg); those missing on a machine are skipped
MAN_PAGES = ("bash", "git", "gitcore-tutorial", "gittutorial-2", "gitcvs-migration",
             "man-pages", "file-hierarchy", "deb-version", "make", "ssh", "gpg", "tar", "less",
             "man", "find", "grep", "systemd.time", "utf-8", "dpkg")
MIN_CONTEXT_WORDS = 15
CONTINUATION_WORDS = (5, 40)
NEAREST = 8           # distractors are drawn from this many continuations nearest in length
SKIP_SECTIONS = {"NAME", "SYNOPSIS", "SEE ALSO", "AUTHOR", "AUTHORS", "COPYRIGHT", "LICENSE",
                 "REPORTING BUGS", "EXAMPLES", "EXAMPLE", "FILES", "NOTES", "COLOPHON"}
_ASCII = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"',
                        "\u2010": "-", "\u2013": "-", "\u2014": "-", "\u00a0": " "})
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[A-Z\"'(\[])")
_CODE = set("{}<>|=$;\\`#*_/")

SAMPLE = (
    "The cat sat on the warm mat by the door of the old house all afternoon long. "
    "It watched the birds in the garden with great interest and did not move at all. "
    "Later it went inside to sleep.\n\n"
    "A river runs through the middle of the town and divides it into two parts that "
    "are joined by three bridges. The oldest bridge is made of stone and is very narrow. "
    "Cars may not cross it.\n\n"
    "The library opens at nine in the morning and closes at six in the evening on most "
    "days of the week. On Sundays it stays closed for cleaning and repairs. "
    "Books can be returned at any time.\n\n"
    "Bread is made from flour, water, salt and yeast that are mixed together and left "
    "to rise for a few hours. The dough is then shaped into loaves and baked in a hot "
    "oven. It should cool before cutting.\n\n")


def render_man(page: str) -> str:
    """The text of manual page ``page`` as ``man`` prints it, one paragraph a line (a wide
    page: no wrapping, no hyphenation); ValueError if ``man`` or the page is missing."""
    if shutil.which("man") is None:
        raise ValueError("the man command is not installed: give a text file or folder")
    # English pages, plain text, one paragraph a line, whatever the user's man settings
    env = {k: v for k, v in os.environ.items()
           if k not in ("MANPAGER", "MANOPT", "MANROFFOPT", "MAN_KEEP_FORMATTING", "LANGUAGE")}
    env.update(MANWIDTH="4000", LC_ALL="C.UTF-8")
    r = subprocess.run(["man", "-P", "cat", page], capture_output=True, text=True, env=env,
                       timeout=120)
    if r.returncode != 0 or not r.stdout.strip():
        raise ValueError(f"no manual page {page!r} ({r.stderr.strip()[:200]})")
    return r.stdout


def man_prose(text: str) -> str:
    """The body paragraphs of a rendered manual page, blank-line separated, without the
    sections that are not prose (synopsis, examples, files, authors, copyright, ...)."""
    out, keep = [], True
    for line in text.splitlines():
        if line and not line[0].isspace():           # a section heading (or the header)
            keep = line.strip().upper() not in SKIP_SECTIONS
            continue
        if keep:
            out.append(line.strip())
    return "\n".join(out)


def passages(text: str) -> list[list[str]]:
    """Paragraphs of ``text`` that read as prose, each split into sentences.

    Example:
        >>> [len(p) for p in passages(SAMPLE)]
        [3, 3, 3, 3]
    """
    out = []
    for block in re.split(r"\n\s*\n", text.translate(_ASCII)):
        para = " ".join(block.split())
        words = para.split()
        if len(words) < 25 or not para[0].isupper() or para[-1] not in ".!?\"')":
            continue
        visible = [c for c in para if not c.isspace()]
        if sum(c.isalpha() for c in visible) < 0.8 * len(visible):
            continue
        if sum(c in _CODE for c in para) > 2 or " -" in f" {words[0]}":
            continue
        sentences = [s for s in _SENTENCE_END.split(para) if s]
        if len(sentences) >= 2:
            out.append(sentences)
    return out


def _candidate(sentences: list[str]) -> tuple[str, str] | None:
    """(question, continuation) of one paragraph: the fewest first sentences that make
    ``MIN_CONTEXT_WORDS`` words, then the next sentence if its length suits."""
    lo, hi = CONTINUATION_WORDS
    for k in range(1, len(sentences)):
        context = " ".join(sentences[:k])
        if len(context.split()) >= MIN_CONTEXT_WORDS:
            nxt = sentences[k]
            return (context, nxt) if lo <= len(nxt.split()) <= hi else None
    return None


def make_items(docs: dict[str, str], *, items: int = 80, seed: int = 0,
               choices: int = 4) -> list[dict]:
    """``items`` multiple-choice items from ``docs`` (name -> text), drawn in turn from each
    document; each ``{"context", "choices", "answer" (index of the gold), "source"}``.

    Raises ValueError when the text gives too few usable paragraphs.
    """
    if items < 1 or choices < 2:
        raise ValueError(f"items must be >= 1 and choices >= 2, got {items}, {choices}")
    rng = random.Random(seed)
    pool = []           # (doc, context, continuation) of every usable paragraph
    for name in sorted(docs):
        for sentences in passages(docs[name]):
            c = _candidate(sentences)
            if c is not None:
                pool.append((name, *c))
    if len(pool) < max(items, choices + NEAREST // 2):
        raise ValueError(f"the source gives {len(pool)} usable paragraphs (prose, 25+ words, "
                         f"2+ sentences), fewer than the {items} items asked (--items)")
    by_doc: dict[str, list[int]] = {}
    for i, (name, _, _) in enumerate(pool):
        by_doc.setdefault(name, []).append(i)
    for ids in by_doc.values():
        rng.shuffle(ids)
    chosen: list[int] = []
    while len(chosen) < items:             # round robin: no one page makes the whole task
        for name in sorted(by_doc):
            if by_doc[name] and len(chosen) < items:
                chosen.append(by_doc[name].pop())
    out = []
    for i in chosen:
        name, context, gold = pool[i]
        others = sorted((j for j in range(len(pool)) if j != i and pool[j][2] != gold),
                        key=lambda j: (abs(len(pool[j][2]) - len(gold)), j))
        picks = rng.sample(others[:max(NEAREST, choices - 1)], choices - 1)
        options = [gold] + [pool[j][2] for j in picks]
        order = list(range(choices))
        rng.shuffle(order)
        out.append({"context": context, "choices": [options[k] for k in order],
                    "answer": order.index(0), "source": name})
    return out


def digest(items: list[dict]) -> str:
    """sha256 of the items (as written): the same text and seed give the same digest."""
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
        raise ValueError(f"task name (--name) must be letters, digits and _, got {name!r}")


def write_task(items: list[dict], out: str | pathlib.Path, *, name: str = "heldout_mc",
               **meta) -> pathlib.Path:
    """Write ``NAME.yaml`` (an ``lm-eval`` multiple-choice task), ``NAME.jsonl`` and
    ``NAME.meta.json`` (``meta``, item count, digest) under ``out``; return the YAML path.
    The YAML names the jsonl by its absolute path (``lm-eval`` reads data files relative
    to the working directory): move the folder and write it again."""
    import yaml

    _check_name(name)
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    # field names, not Jinja templates: the prose may hold braces
    config = {"task": name, "output_type": "multiple_choice", "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
              "test_split": "test", "doc_to_text": "context", "doc_to_choice": "choices",
              "doc_to_target": "answer",
              "metric_list": [{"metric": "acc", "aggregation": "mean",
                               "higher_is_better": True},
                              {"metric": "acc_norm", "aggregation": "mean",
                               "higher_is_better": True}],
              "metadata": {"version": 1.0}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    (folder / f"{name}.meta.json").write_text(json.dumps(
        {**meta, "task": name, "items": len(items), "choices": len(items[0]["choices"]),
         "sha256": digest(items)}, indent=1) + "\n", encoding="utf-8")
    return path


def _refuse_seen(path: pathlib.Path) -> None:
    """Text distillation trains on or the README evaluates on is not held out."""
    seen = {"the Python standard library (distillation's training data)":
            pathlib.Path(sysconfig.get_paths()["stdlib"]),
            "/usr/share/common-licenses (the README's evaluation text)":
            pathlib.Path("/usr/share/common-licenses")}
    real = path.resolve()
    for what, root in seen.items():
        if real == root.resolve() or root.resolve() in real.parents:
            raise ValueError(f"{path} is in {what}: not held-out text")


def read_source(source: str) -> dict[str, str]:
    """Documents (name -> text) of a source: ``man`` (the pages of :data:`MAN_PAGES` that
    exist here), ``man:PAGE,PAGE``, a text file, or a folder (its ``*.txt``, ``*.md``,
    ``*.rst`` files, recursively, in name order)."""
    if source == "man" or source.startswith("man:"):
        pages = MAN_PAGES if source == "man" else [p for p in source[4:].split(",") if p]
        docs = {}
        for page in pages:
            try:
                docs[f"man {page}"] = man_prose(render_man(page))
            except ValueError:
                if source != "man":          # a page asked by name must exist
                    raise
        if not docs:
            raise ValueError(f"none of the manual pages of {source!r} exists on this machine")
        return docs
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"SOURCE {source!r}: no such file or folder (or give man, "
                         "man:PAGE,PAGE)")
    _refuse_seen(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".rst") and p.is_file())
    if not files:
        raise ValueError(f"SOURCE {source!r} holds no .txt, .md or .rst file")
    return {str(f.relative_to(path)) if f != path else f.name:
            f.read_text(encoding="utf-8", errors="replace") for f in files}


def make_mc(source: str, out: str | pathlib.Path, *, items: int = 80, seed: int = 0,
            name: str = "heldout_mc") -> dict:
    """``hyla eval make-mc``: read ``source`` (see :func:`read_source`), build ``items``
    items and write the task under ``out``; returns its ``meta.json`` record."""
    _check_name(name)
    docs = read_source(source)
    chosen = make_items(docs, items=items, seed=seed)
    sources = sorted({i["source"] for i in chosen})
    path = write_task(chosen, out, name=name, source=source, seed=seed, documents=sources)
    return json.loads((path.parent / f"{name}.meta.json").read_text())
