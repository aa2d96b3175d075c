"""Conversations written by the teacher, mixed into the distillation data.

A student distilled on source code alone keeps the teacher's perplexity on code and loses
what an instruction-tuned teacher does after its chat template: answer a request. LoLCATs
distils on instruction data (Alpaca) and Mamba-in-the-Llama on the teacher's own chat
outputs; with no data set to download here, hyla makes that data: requests built from the
functions of the Python standard library's training split (write a function from its
docstring, explain a function, document a piece of code), each answered by the teacher
(greedy; ``hyla distill`` batches them in hyla's engine) in its chat template. The functions
the generation evaluation asks for (:mod:`hyla.eval.writing_tasks`) are left out.

Example:
    >>> asks = requests(4, seed=0)
    >>> len(asks), all(isinstance(a, str) and a for a in asks)
    (4, True)
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import random

from hyla.data.corpus import stdlib_files
from hyla.data.tokenizer import stop_ids

ASK_WRITE = ("Write a Python function `{name}({args})` that does what its docstring says: "
             "{doc} Reply with one code block.")
ASK_EXPLAIN = "Explain in two or three sentences what the Python function `{module}.{name}` does."
ASK_DOCUMENT = "Write a one-line docstring for this Python function:\n```python\n{code}```"
MAX_CODE_LINES = 20


@functools.lru_cache(maxsize=4096)
def _functions(path: pathlib.Path) -> tuple[dict, ...]:
    """The public top-level functions of one stdlib file that have a docstring."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    lines = source.splitlines(keepends=True)
    found = []
    for node in tree.body:
        doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
        if not doc or node.name.startswith("_"):
            continue
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not 20 <= len(first) <= 300:
            continue
        doc_node = node.body[0]          # the docstring, left out of the code shown
        code = "".join(lines[node.lineno - 1:doc_node.lineno - 1]
                       + lines[doc_node.end_lineno:node.end_lineno])
        found.append({"name": node.name, "args": ", ".join(a.arg for a in node.args.args),
                      "doc": first, "module": path.stem,
                      "code": code if code.count("\n") <= MAX_CODE_LINES else None})
    return tuple(found)


def requests(n: int, seed: int = 0) -> list[str]:
    """``n`` user requests (ValueError if the stdlib has too few functions), in three kinds
    taken in turn, from functions drawn at random (``seed``) from the training split."""
    from hyla.eval import writing_tasks

    held_out = {name for name, *_ in writing_tasks.PYTHON}
    files = stdlib_files("train")
    rng = random.Random(seed)
    rng.shuffle(files)
    funcs = []
    for path in files:          # files in a random order, read until there are enough
        funcs += [f for f in _functions(path) if f["name"] not in held_out]
        if len(funcs) >= 4 * n:
            break
    rng.shuffle(funcs)
    asks = []
    for i, f in enumerate(funcs):
        kind = i % 3
        if kind == 2 and f["code"] is None:
            kind = i % 2
        template = (ASK_WRITE, ASK_EXPLAIN, ASK_DOCUMENT)[kind]
        asks.append(template.format(**f))
        if len(asks) == n:
            return asks
    raise ValueError(f"the standard library gives {len(asks)} requests, fewer than {n}")


def teacher_conversations(teacher, tokenizer, asks: list[str], *, max_tokens: int = 256,
                          answer=None) -> list[str]:
    """Each request and the teacher's greedy answer, as text in the teacher's chat template
    (ValueError when the tokenizer has none). ``answer(teacher, prompts, max_tokens,
    stop_ids) -> [new ids]`` answers a batch (``hyla distill`` passes one through the
    serving engine, which batches them); None: one at a time."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the teacher's tokenizer has no chat template: teacher conversations "
                         "need one (use --chat-data 0)")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a in asks]
    ids = [tokenizer.encode(p) for p in prompts]
    stops = stop_ids(tokenizer)
    if answer is None:
        from hyla.model.generate import generate

        outs = [generate(teacher, p, max_tokens, temperature=0.0, stop_ids=stops) for p in ids]
    else:
        outs = answer(teacher, ids, max_tokens, stops)
    end = tokenizer.decode([stops[0]]) if stops else ""
    return [p + tokenizer.decode([t for t in o if t not in stops]) + end
            for p, o in zip(prompts, outs, strict=True)]


def load_or_make(path: pathlib.Path, teacher, tokenizer, n: int, seed: int,
                 log=lambda _line: None, answer=None) -> list[str]:
    """The ``n`` teacher conversations saved at ``path`` (a JSON list), made and saved there
    first when absent or of another count (a resumed run reads what its first part made)."""
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(saved, list) and len(saved) == n:
            return saved
    log(f"the teacher answers {n} requests (its chat data)")
    chats = teacher_conversations(teacher, tokenizer, requests(n, seed), answer=answer)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(chats), encoding="utf-8")
    tmp.replace(path)
    return chats


def mixture(chats: list[str], tokenizer, share: float, files: list[pathlib.Path] | None = None,
            seed: int = 0) -> list:
    """Documents for training: the conversations plus ``files`` (default: the stdlib's
    training split) drawn at random (``seed``) until the conversations are ``share`` of the
    tokens, within 10% (a file that would overshoot is passed over)."""
    if not 0 < share <= 1:
        raise ValueError(f"--chat-share must be in (0, 1], got {share}")
    want = sum(len(tokenizer.encode(c)) for c in chats) * (1 - share) / share
    files = list(stdlib_files("train") if files is None else files)
    random.Random(seed).shuffle(files)
    docs, have = list(chats), 0
    for f in files:
        if have >= 0.9 * want:
            break
        if f.stat().st_size > 8 * (1.1 * want - have):     # surely too long (>= 1 byte a token)
            continue
        n = len(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")))
        if have + n <= 1.1 * want:
            docs.append(f)
            have += n
    return docs
