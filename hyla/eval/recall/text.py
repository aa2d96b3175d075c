"""Key-value recall written as text, for any model ``load_model`` takes.

The text form of MQAR: a context states ``P`` facts, ``" The code of Kobi is 4821."``, and
then asks ``" The code of Kobi is"``; the model answers greedily and scores when the first
number of its answer is the value (exact match). Names are two or three made-up syllables
(distinct within a context, no prior knowledge to lean on), values four-digit numbers.

Two context lengths:

- ``growing``: the context is only the facts, so it grows with the load;
- ``fixed``: every load is padded to the same number of tokens with neutral filler spread
  between the facts (by default the length of the largest load's facts), so the load
  changes and the context does not. A fixed state is then asked to hold more in the same
  number of tokens; an attention cache is the same size at every load.

Each context is prefilled once; up to ``queries`` of its keys are then asked from copies of
that state (``SequenceState.clone``), decoded together in one batch: the model's own
``prefill``/``decode``, the path ``hyla generate`` and the serving runner take.

Example:
    >>> import torch
    >>> from hyla.data import ByteTokenizer
    >>> from hyla.model import HylaLM, preset
    >>> torch.manual_seed(0) and None
    >>> recs = text_recall(HylaLM(preset("debug")).eval(), ByteTokenizer(), (2, 4),
    ...                    contexts=("growing",), limit=2, name="debug")
    >>> [(r["mixer"], r["num_kv_pairs"], r["queries"]) for r in recs]
    [('debug', 2, 2), ('debug', 4, 2)]
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from hyla.eval.memory import state_bytes
from hyla.eval.needle import FILLER, answered

PAIRS = (2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = ("growing", "fixed")
HEADER = "Here is a list of codes. Remember them."
_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


def make_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct made-up names (``"Kobi"``, ``"Rutase"``): 2-3 syllables, capitalised.

    Example:
        >>> names = make_names(random.Random(0), 300)
        >>> len(set(names)), all(n[0].isupper() and n.isalpha() for n in names)
        (300, True)
    """
    if n > len(_ONSETS) ** 2 * len(_VOWELS) ** 2 * 4:
        raise ValueError(f"at most {len(_ONSETS) ** 2 * len(_VOWELS) ** 2 * 4} names, got {n}")
    names: set[str] = set()
    out = []
    while len(out) < n:
        syllables = rng.choice((2, 2, 3))
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        if name not in names:
            names.add(name)
            out.append(name.capitalize())
    return out


def fact(name: str, value: int) -> str:
    return f" The code of {name} is {value}."


def question(name: str) -> str:
    return f" The code of {name} is"


def build_context(tokenizer, facts: Sequence[tuple[str, int]], length: int | None = None
                  ) -> list[int]:
    """Token ids of the header and the facts; with ``length``, filler spread between the
    facts (after each one) brings it to exactly ``length`` tokens.

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> tok = ByteTokenizer()
        >>> ids = build_context(tok, [("Kobi", 4821), ("Ada", 1234)], length=200)
        >>> len(ids), "The code of Ada is 1234." in tok.decode(ids)
        (200, True)
    """
    parts = [tokenizer.encode(HEADER)] + [tokenizer.encode(fact(n, v)) for n, v in facts]
    used = sum(len(p) for p in parts)
    if length is None:
        return [t for p in parts for t in p]
    budget = length - used
    if budget < 0:
        raise ValueError(f"context length {length} is shorter than the {len(facts)} facts "
                         f"({used} tokens)")
    unit = tokenizer.encode(FILLER)
    filler = (unit * (budget // len(unit) + 1))[:budget]
    out = list(parts[0])
    for i, p in enumerate(parts[1:]):
        # Filler after fact i: an even share, so the facts span the whole context.
        lo, hi = budget * i // len(facts), budget * (i + 1) // len(facts)
        out += p + filler[lo:hi]
    return out


def _facts(rng: random.Random, pairs: int) -> list[tuple[str, int]]:
    names = make_names(rng, pairs)
    values = rng.sample(range(1000, 10000), pairs)
    return list(zip(names, values, strict=True))


def fixed_length(tokenizer, pairs: int, seed: int = 0) -> int:
    """The ``fixed`` context length for loads up to ``pairs``: the tokens of a ``pairs``-fact
    context, plus 5% (names vary in length), rounded up to a multiple of 64."""
    ids = build_context(tokenizer, _facts(random.Random(seed), pairs))
    return 64 * math.ceil(1.05 * len(ids) / 64)


@torch.no_grad()
def _ask(model, tokenizer, context: list[int], asked: list[tuple[str, int]]) -> int:
    """Prefill ``context`` once, ask each of ``asked`` from a copy of its state; correct count.
    """
    device = model.embed.weight.device
    state = model.new_state()
    model.prefill(torch.tensor(context, device=device), state)
    states = [state.clone() for _ in asked]
    logits = torch.stack([model.prefill(torch.tensor(tokenizer.encode(question(n)),
                                                      device=device), s)[-1]
                          for (n, _), s in zip(asked, states, strict=True)])
    # Enough tokens for " 4821" under any tokenizer, and one more: an extra digit is wrong.
    steps = max(len(tokenizer.encode(f" {v}")) for _, v in asked) + 1
    out: list[list[int]] = [[] for _ in asked]
    for step in range(steps):
        tokens = logits.argmax(-1)
        for row, t in zip(out, tokens.tolist(), strict=True):
            row.append(t)
        if step + 1 < steps:
            logits = model.decode(tokens, states)
    return sum(answered(tokenizer.decode(row), v) for row, (_, v) in zip(out, asked,
                                                                          strict=True))


def text_recall(model, tokenizer, pairs: Sequence[int] = PAIRS, *,
                contexts: Sequence[str] = CONTEXTS, limit: int = 16, queries: int = 8,
                seed: int = 0, context_len: int | None = None, name: str = "model",
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """Exact-match recall of ``limit`` questions at every load of ``pairs`` and every kind of
    context (``growing``, ``fixed``); each context is asked up to ``queries`` of its keys.

    Records have the synthetic sweep's keys: ``mixer`` (``name``), ``description``,
    ``num_kv_pairs``, ``seq_len`` (mean context tokens), ``accuracy``, ``state_bytes`` (the
    model's per-sequence state at that length), ``seed``, ``best`` (True), plus
    ``context``, ``correct`` and ``queries``.
    """
    pairs = sorted(set(pairs))
    if not pairs or any(not isinstance(p, int) or p < 1 for p in pairs):
        raise ValueError(f"pairs must be positive ints, got {list(pairs)}")
    bad = set(contexts) - set(CONTEXTS)
    if not contexts or bad:
        raise ValueError(f"contexts must be some of {list(CONTEXTS)}, got {list(contexts)}")
    for label, value in (("limit", limit), ("queries", queries)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    length = None
    if "fixed" in contexts:
        length = context_len or fixed_length(tokenizer, max(pairs), seed)
    dtype = model.embed.weight.dtype
    records = []
    for kind in contexts:
        for p in pairs:
            # The same facts for a load in both kinds of context: only the filler differs.
            rng = random.Random(f"{seed}-{p}")
            correct = asked_total = tokens = n_ctx = 0
            while asked_total < limit:
                facts = _facts(rng, p)
                asked = rng.sample(facts, min(p, queries, limit - asked_total))
                ids = build_context(tokenizer, facts, length if kind == "fixed" else None)
                correct += _ask(model, tokenizer, ids, asked)
                asked_total += len(asked)
                tokens += len(ids)
                n_ctx += 1
            seq_len = round(tokens / n_ctx)
            rec = {"mixer": name, "description": f"{name}, {kind} context", "context": kind,
                   "num_kv_pairs": p, "seq_len": seq_len, "accuracy": correct / asked_total,
                   "correct": correct, "queries": asked_total,
                   "state_bytes": state_bytes(model.cfg, seq_len, kv_dtype=dtype)["total"],
                   "seed": seed, "best": True}
            records.append(rec)
            if progress is not None:
                progress(f"{name} {kind:>7} {p:4d} pairs, {seq_len:5d} tokens: "
                         f"{correct}/{asked_total}")
    return records
