"""Autoregressive sampling for one prompt: prefill once, then decode token by token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyla.model.model import HylaLM
from hyla.model.sampler import sample_token


def generate(model: HylaLM, prompt_ids: list[int], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
             stop_ids: tuple[int, ...] | list[int] = (),
             until: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    ``temperature == 0`` is greedy; otherwise tokens are sampled from softmax(logits /
    temperature), restricted to the ``top_k`` most likely when given: the serving engine's
    sampler (:func:`hyla.model.sampler.sample_token`). ``seed`` makes sampling
    reproducible. Generation stops early at the first token in ``stop_ids``, or once
    ``until(new tokens so far)`` is true (a stop string, a finished function).

    Returns:
        the new tokens only (not the prompt), without the stop token.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug")).eval()
        >>> len(generate(model, [1, 2, 3], 4, temperature=0))
        4
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token, got []")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    device = model.anchor.device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    stop = set(stop_ids)
    state = model.new_state()
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    logits = model.prefill(torch.tensor(prompt_ids, device=device), state)[-1]
    while True:
        token = sample_token(logits, temperature, top_k or 0, 1.0, gen)
        if token in stop:
            break
        out.append(token)
        if len(out) == max_new_tokens or until is not None and until(out):
            break
        logits = model.decode(torch.tensor([token], device=device), [state])[0]
    return out
