"""Turn logits into tokens: the one sampler of hyla, used by the serving engine (a batch,
each row with its own parameters) and by :func:`hyla.model.generate` (one sequence).

Parameters are read by attribute (``temperature``, ``top_k``, ``top_p``, ``logprobs``), so
the serving layer's torch-free ``SamplingParams`` passes as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Temperatures below this are greedy: dividing logits by a (near-)zero temperature would
# overflow to inf and turn the softmax into NaN (vLLM uses the same threshold).
GREEDY_BELOW = 1e-5
# top-p looks for its nucleus among this many likeliest tokens before it sorts them all
NUCLEUS_CANDIDATES = 1024


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and nucleus (top-p) sampling exclude; logits [V].

    Example:
        >>> filter_logits(torch.tensor([3.0, 2.0, 1.0]), top_k=2, top_p=1.0)
        tensor([3., 2., -inf])
    """
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Keep the smallest prefix (by probability) whose mass reaches top_p, always the
        # first token. Sorting a 49K vocabulary took 2.6 ms a row on a Xeon: look among the
        # NUCLEUS_CANDIDATES likeliest first; where they hold top_p of the mass the nucleus
        # is among them, and everything else is dropped.
        k = min(NUCLEUS_CANDIDATES, logits.numel())
        top, order = torch.topk(logits, k)
        probs = torch.exp(top - torch.logsumexp(logits, dim=-1))
        if k < logits.numel() and not float(probs.sum()) >= top_p:
            top, order = torch.sort(logits, descending=True)
            probs = torch.softmax(top, dim=-1)
        keep = order[~(probs.cumsum(-1) - probs >= top_p)]
        logits = torch.full_like(logits, float("-inf")).index_copy_(0, keep, logits[keep])
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index drawn from ``probs`` [V] (non-negative, finite, not all zero; need not sum
    to 1) by inverting its cumulative sum at one uniform number: 0.03 ms for 49K entries
    where ``torch.multinomial`` took 0.9 ms (it draws a random number per entry). An entry
    of probability 0 is never drawn.

    Example:
        >>> draw(torch.tensor([0.0, 0.0, 2.0]))
        2
    """
    cdf = probs.cumsum(-1)
    u = torch.rand((), dtype=cdf.dtype, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    # u rounded up to the total: the last entry that has some probability
    return i if i < probs.numel() else int(probs.nonzero()[-1])


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` picks the argmax (below ``GREEDY_BELOW``, 0 included)."""
    return temperature < GREEDY_BELOW


def sample_token(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """One token from ``logits`` [V]: the argmax when greedy (temperature below
    ``GREEDY_BELOW``), else a draw from softmax(filtered logits / temperature).

    Example:
        >>> sample_token(torch.tensor([0.0, 5.0, 1.0]), temperature=0)
        1
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if is_greedy(temperature):
        return int(logits.argmax())
    # float64: a huge (finite) temperature would overflow to inf as a float32 scalar and
    # turn masked logits (-inf / inf) into NaN; in float64 every finite one is exact.
    row = filter_logits(logits.double(), top_k, top_p) / temperature
    probs = torch.softmax(row, dim=-1)
    # a draw needs a finite distribution with some mass; name the cause otherwise (NaN
    # logits from the model, say): the caller fails this one request, not the batch.
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise ValueError("cannot sample: the distribution is not finite (NaN or inf logits)")
    return draw(probs, generator)


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits`` [B, V] (fp32), row b with ``params[b]``.

    Greedy rows take the argmax; the others sample with :func:`sample_token`, with the
    row's generator when it has a seed. Log-probabilities (when ``logprobs`` is not None)
    are of the model's distribution, before filtering.

    Example:
        >>> from types import SimpleNamespace
        >>> p = SimpleNamespace(temperature=0, top_k=0, top_p=1.0, logprobs=None)
        >>> sample(torch.tensor([[0.0, 5.0]]), [p], [None])[0]
        [1]
    """
    # max's indices: the same first maximum as argmax's, 2.5x faster on CPU ([16, 49152]:
    # 0.5 against 1.2 ms, one thread; a sixtieth of a 16-wide SmolLM2 step)
    tokens = logits.max(dim=-1).indices.tolist()
    logps: list[TokenLogprob | None] = [None] * len(params)
    for b, p in enumerate(params):
        if not is_greedy(p.temperature):
            tokens[b] = sample_token(logits[b], p.temperature, p.top_k, p.top_p, generators[b])
        if p.logprobs is not None:
            lp = torch.log_softmax(logits[b], dim=-1)
            top = torch.topk(lp, min(p.logprobs, lp.numel())) if p.logprobs else None
            # tokens a grammar ruled out (-inf) are no alternatives: fewer than asked then
            alts = [] if top is None else [
                (t, v) for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                if v != float("-inf")]
            logps[b] = TokenLogprob(tokens[b], float(lp[tokens[b]]), alts)
    return tokens, logps


def accept_drafts(logits: torch.Tensor, drafts: list[int], params,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative decoding's verdict on ``drafts``: ``logits`` [len(drafts) + 1, V] are the
    model's at each draft's place and after the last. Returns (how many drafts are kept,
    the token that follows them).

    Greedy: drafts are kept while they are the argmax; the next token is the argmax. Sampled
    (the speculative sampling rule, with a draft that put all its mass on its token): draft
    ``d`` is kept with probability ``p(d)`` under the row's filtered, tempered distribution;
    at the first one refused, the token is drawn from ``p`` without ``d`` (renormalised);
    with all kept, from the last row. Each emitted token is then distributed exactly as
    plain sampling's.

    Example:
        >>> from types import SimpleNamespace
        >>> greedy = SimpleNamespace(temperature=0, top_k=0, top_p=1.0)
        >>> accept_drafts(torch.tensor([[0.0, 9.0], [9.0, 0.0]]), [1], greedy)
        (1, 0)
    """
    if is_greedy(params.temperature):
        best = logits.max(dim=-1).indices.tolist()
        j = 0
        while j < len(drafts) and drafts[j] == best[j]:
            j += 1
        return j, best[j]
    for j, d in enumerate(drafts + [None]):
        row = filter_logits(logits[j].double(), params.top_k, params.top_p) / params.temperature
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            raise ValueError("cannot sample: the distribution is not finite (NaN or inf logits)")
        if d is None:
            return j, draw(probs, generator)
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u < float(probs[d]):
            continue
        rest = probs.clone()
        rest[d] = 0.0
        return j, draw(rest, generator)
    raise AssertionError("unreachable")
