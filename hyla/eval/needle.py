"""Passkey retrieval ("needle in a haystack"): can the model recall a number it read long ago?

A five-digit key is hidden in repeated filler text at a relative depth of the context, and
the prompt ends by asking for it; the model answers greedily. Accuracy is reported per
(context length, depth) cell: for a GLA model this probes what its fixed-size state kept.
"""

from __future__ import annotations

import random
import re

import torch

from hyla.model.generate import generate

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> list[int]:
    """Token ids of a prompt of exactly ``context`` tokens with ``key`` at ``depth`` (0..1).

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> ids = passkey_prompt(ByteTokenizer(), 300, 0.5, 12345)
        >>> len(ids), "pass key is 12345" in ByteTokenizer().decode(ids)
        (300, True)
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(QUESTION)
    budget = context - len(needle) - len(question)
    if budget < 0:
        raise ValueError(f"context={context} is too short for the needle and the question "
                         f"({len(needle) + len(question)} tokens)")
    unit = tokenizer.encode(FILLER)
    filler = (unit * (budget // len(unit) + 1))[:budget]
    at = round(depth * budget)
    return filler[:at] + needle + filler[at:] + question


def answered(text: str, key: int) -> bool:
    """True if the first number in the model's answer is the key.

    Example:
        >>> answered(" 12345. Remember", 12345), answered(" 1234", 12345)
        (True, False)
    """
    found = re.search(r"\d+", text)
    return found is not None and int(found.group()) == key


@torch.no_grad()
def needle_eval(model, tokenizer, contexts: list[int], depths=DEPTHS, *, trials: int = 3,
                seed: int = 0, max_new_tokens: int = 8) -> list[dict]:
    """Accuracy of greedy passkey retrieval for every (context, depth) cell.

    Returns one record per cell: {"context", "depth", "trials", "correct", "accuracy"}.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    rng = random.Random(seed)
    records = []
    for context in contexts:
        for depth in depths:
            correct = 0
            for _ in range(trials):
                key = rng.randrange(10000, 100000)
                prompt = passkey_prompt(tokenizer, context, depth, key)
                new = generate(model, prompt, max_new_tokens, temperature=0.0)
                correct += answered(tokenizer.decode(new), key)
            records.append({"context": context, "depth": depth, "trials": trials,
                            "correct": correct, "accuracy": correct / trials})
    return records


def plot_needle(records: list[dict], path) -> None:
    """Heat map of accuracy: depth (rows) by context length (columns), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in records})
    depths = sorted({r["depth"] for r in records})
    grid = [[next(r["accuracy"] for r in records if r["context"] == c and r["depth"] == d)
             for c in contexts] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(contexts) + 2, 0.6 * len(depths) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(contexts)), [f"{c:,}" for c in contexts])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("passkey retrieval accuracy")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
