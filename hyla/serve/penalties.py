"""Presence, frequency and repetition penalties on a step's logits (OpenAI's and vLLM's).

Applied by the engine before grammar masks and sampling, to the rows of requests that set
them: ``logit -= presence * [count > 0] + frequency * count`` for each token's count in the
output so far; with ``repetition_penalty`` r, a token seen in the prompt or the output has
a positive logit divided by r and a negative one multiplied by r (the CTRL rule vLLM and
transformers use).

Example:
    >>> from hyla.serve.sequence import SamplingParams
    >>> logits = torch.zeros(1, 4)
    >>> p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    >>> apply_penalties(logits, [p], [[7]], [[2, 2, 3]]); logits.tolist()
    [[0.0, 0.0, -2.0, -1.5]]
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, params: list, prompts: list[list[int]],
                    outputs: list[list[int]]) -> None:
    """Penalise ``logits`` [B, V] in place, row b by ``params[b]``, from its prompt and
    output token ids."""
    V = logits.shape[1]
    for b, p in enumerate(params):
        if not p.penalised:
            continue
        row = logits[b]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in prompts[b] + outputs[b] if t < V}),
                                dtype=torch.long, device=row.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and outputs[b]:
            ids, counts = torch.tensor(outputs[b], device=row.device).unique(return_counts=True)
            keep = ids < V
            ids, counts = ids[keep], counts[keep].to(row.dtype)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts
