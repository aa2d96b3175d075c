"""Turn a batch of logits into tokens, each row with its own SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.serve.sequence import SamplingParams


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
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits`` [B, V] (fp32).

    Greedy rows (temperature 0) take the argmax; the others sample from
    softmax(filtered logits / temperature), with the row's generator when it has a seed.
    Log-probabilities (when asked for) are of the model's distribution, before filtering.

    Example:
        >>> toks, _ = sample(torch.tensor([[0.0, 5.0]]), [SamplingParams(temperature=0)], [None])
        >>> toks
        [1]
    """
    tokens = logits.argmax(dim=-1).tolist()
    logps: list[TokenLogprob | None] = [None] * len(params)
    for b, p in enumerate(params):
        if not p.greedy:
            row = filter_logits(logits[b], p.top_k, p.top_p) / p.temperature
            probs = torch.softmax(row, dim=-1)
            tokens[b] = int(torch.multinomial(probs, 1, generator=generators[b]))
        if p.logprobs is not None:
            lp = torch.log_softmax(logits[b], dim=-1)
            top = torch.topk(lp, p.logprobs) if p.logprobs else None
            logps[b] = TokenLogprob(tokens[b], float(lp[tokens[b]]),
                                    list(zip(top.indices.tolist(), top.values.tolist(),
                                             strict=True)) if top is not None else [])
    return tokens, logps
