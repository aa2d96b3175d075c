"""MQAR (multi-query associative recall) data, as defined by the Zoology benchmark.

Each example is ``num_kv_pairs`` key-value pairs, then the keys asked again in random order
at gaps drawn from a power law (short gaps likely), with filler tokens everywhere else::

    k1 v1 k2 v2 ... kP vP | f f k2 f k1 f f f kP f ...
    labels:   -100 ...    | -100 ...  v2 ... v1 ...  vP ...   (the value, at the key's position)

Keys come from the first half of the vocabulary (without 0), values from the second half;
keys are distinct and values are distinct within an example. The label at a query position is
the value that was paired with that key, so a next-token model must recall it. Zoology's
generator (``zoology/data/associative_recall.py``, ``multiquery_ar``) is followed: the queried
key sits on an even offset ``2 * gap`` of the query region, gaps are distinct draws with
probability ``a * gap ** (a - 1)`` (``power_a = 0.01``), and filler is uniform over the whole
vocabulary (so a filler may equal a key; it is never labelled), or token 0 everywhere with
``random_filler=False`` (Zoology's ``random_non_queries=False``): then only the pairs write
into a recurrent state, and what it holds is measured without the noise of filler writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # labels not scored (torch's cross_entropy default ignore_index)


@dataclass(frozen=True)
class MQARBatch:
    """``inputs`` and ``labels``: [N, seq_len] long; labels are ``-100`` except at queries."""

    inputs: torch.Tensor
    labels: torch.Tensor
    seq_len: int
    num_kv_pairs: int


def check_mqar_args(vocab_size: int, seq_len: int, num_kv_pairs: int) -> None:
    """Raise ValueError (naming the argument) unless the MQAR shape is valid.

    Example:
        >>> check_mqar_args(8192, 64, 16)
        >>> check_mqar_args(8192, 64, 17)
        Traceback (most recent call last):
        ...
        ValueError: num_kv_pairs=17 must satisfy 4 * num_kv_pairs <= seq_len=64
    """
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len),
                        ("num_kv_pairs", num_kv_pairs)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (queries sit on even offsets), got {seq_len}")
    if vocab_size <= seq_len:
        raise ValueError(f"vocab_size={vocab_size} must be > seq_len={seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"num_kv_pairs={num_kv_pairs} must satisfy 4 * num_kv_pairs <= "
                         f"seq_len={seq_len}")


def _distinct(rng: np.random.Generator, n: int, low: int, high: int, k: int) -> np.ndarray:
    """``n`` rows of ``k`` distinct ints from ``[low, high)``, uniformly (argsort of noise)."""
    return rng.random((n, high - low)).argsort(axis=1)[:, :k] + low


def mqar(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, *,
         seed: int = 0, power_a: float = 0.01, random_filler: bool = True) -> MQARBatch:
    """Generate ``num_examples`` MQAR sequences (deterministic for a given ``seed``).

    Example:
        >>> b = mqar(2, 16, 3, 32, seed=0)
        >>> b.inputs.shape, int((b.labels != -100).sum())
        (torch.Size([2, 16]), 6)
        >>> bool((b.inputs[:, 0:6:2] < 16).all() and (b.inputs[:, 1:6:2] >= 16).all())
        True
    """
    if not isinstance(num_examples, int) or num_examples <= 0:
        raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
    check_mqar_args(vocab_size, seq_len, num_kv_pairs)
    if not 0 < power_a <= 1:
        raise ValueError(f"power_a must be in (0, 1], got {power_a}")
    rng = np.random.default_rng(seed)
    n, p, half = num_examples, num_kv_pairs, vocab_size // 2
    keys = _distinct(rng, n, 1, half, p)               # 0 stays out, as in Zoology
    values = _distinct(rng, n, half, vocab_size, p)
    context = 2 * p
    space = (seq_len - context) // 2                    # query slots (even offsets)
    # Distinct gaps drawn with probability ~ gap ** (a - 1): weighted sampling without
    # replacement via the Gumbel-top-k trick (same law as numpy's sequential choice).
    logp = (power_a - 1) * np.log(np.arange(1, space + 1))
    gaps = np.argsort(-(logp + rng.gumbel(size=(n, space))), axis=1)[:, :p]
    inputs = rng.integers(0, vocab_size, size=(n, seq_len))   # filler everywhere first
    if not random_filler:
        inputs[:] = 0
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    # The queries ask the keys in pair order, at their own random gaps: key i at gap i.
    qpos = context + 2 * gaps
    rows = np.arange(n)[:, None]
    inputs[rows, qpos] = keys
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    labels[rows, qpos] = values
    return MQARBatch(torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(labels),
                     seq_len, num_kv_pairs)
