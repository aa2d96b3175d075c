"""Token streaming for one sequence that continues from a kept state (chat, ``generate``).

:func:`stream_tokens` prefills only the tokens it is given onto a :class:`SequenceState` that
may already hold a conversation, then samples token by token, yielding each as it comes. A
hybrid's linear layers carry the whole history in their constant-size state and its attention
layers in their KV rows, so a chat's next turn reads only its own new tokens.

The sampling is :func:`hyla.model.generate.generate`'s (same sampler, same use of the seeded
generator), so the same seed gives the same tokens.

``state`` may also be any object with ``num_tokens``, ``prefill(ids) -> logits [vocab]`` and
``decode(token) -> logits [vocab]``: :class:`hyla.serve.session.RunnerState`, the serving
runner's lean step, is what ``hyla generate`` and ``hyla chat`` pass.

Example:
    >>> import torch
    >>> from hyla.model import HylaLM, preset
    >>> model = HylaLM(preset("debug")).eval()
    >>> state, timing = model.new_state(), StreamTiming()
    >>> first = list(stream_tokens(model, state, [1, 2, 3], 4, temperature=0, timing=timing))
    >>> state.num_tokens, timing.prompt_tokens, timing.new_tokens   # last token: not yet fed
    (6, 3, 4)
    >>> more = list(stream_tokens(model, state, [first[-1], 5], 2, temperature=0))
    >>> state.num_tokens                                            # 6 + 2 fed + 1 decoded
    9
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hyla.model.model import HylaLM
from hyla.model.sampler import sample_token
from hyla.model.state import SequenceState


@dataclass
class StreamTiming:
    """Seconds and token counts of one :func:`stream_tokens` call (filled in as it runs).

    ``prompt_s`` covers the prefill and the first token's sampling; ``decode_s`` every later
    token (each a decode step and a sample).
    """

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0
    stopped: bool = False   # ended on a stop token (else on max_new_tokens)

    @property
    def prompt_tok_s(self) -> float:
        # NaN when nothing was timed (--max-tokens 0 once printed "at inf tok/s")
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Tokens a second after the first (the first one's time is the prompt's)."""
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def stream_tokens(model: HylaLM, state, new_ids: list[int],
                  max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float = 1.0, generator: torch.Generator | None = None,
                  stop_ids: tuple[int, ...] | list[int] = (),
                  timing: StreamTiming | None = None, constraint=None,
                  drafter=None, context: list[int] | tuple[int, ...] = ()) -> Iterator[int]:
    """Prefill ``new_ids`` onto ``state`` (after whatever it holds), then yield up to
    ``max_new_tokens`` sampled tokens, stopping before the first one in ``stop_ids``.

    On return ``state`` holds its old tokens, ``new_ids`` and every yielded token but the
    last: the last is sampled from the state but not yet fed, so a caller that continues
    passes it first among the next ``new_ids`` (nothing is computed that is not needed).
    A stop token is neither yielded nor fed. ``constraint`` (structured output, e.g.
    :class:`hyla.serve.structured.TokenConstraint`): its ``mask(logits)`` rules tokens out
    before each draw and its ``accept(token)`` says when its grammar is complete, which
    ends the stream after that token. ``drafter`` (speculative decoding of a greedy
    stream over a state with ``speculate(token, drafts)``, e.g.
    :class:`hyla.serve.speculative.NgramDrafter` over a RunnerState): its ``draft(tokens,
    room)`` guesses what follows, the state verifies the guesses in one forward, and the
    tokens come out as plain greedy steps would give them. ``context``: the tokens ``state``
    already holds (what the drafter looks at before ``new_ids``: a chat's earlier turns).
    """
    if not new_ids:
        raise ValueError("new_ids must hold at least one token, got []")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    timing = timing if timing is not None else StreamTiming()
    timing.prompt_tokens, timing.new_tokens = len(new_ids), 0
    if max_new_tokens == 0:
        return
    if getattr(drafter, "needs_hidden", False) and hasattr(state, "keep_hidden"):
        drafter.attach(state.keep_hidden(), 0)    # (before the prompt: it drafts from it)
    prefill, decode = _steps(model, state)
    stop = set(stop_ids)
    start = time.perf_counter()
    complete = False

    def pick(logits: torch.Tensor) -> int:
        nonlocal complete
        if constraint is not None:
            constraint.mask(logits)
        t = sample_token(logits, temperature, top_k or 0, top_p, generator)
        complete = constraint is not None and constraint.accept(t)
        return t

    with torch.inference_mode():
        token = pick(prefill(new_ids))
    timing.prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    speculating = drafter is not None and constraint is None and temperature < 1e-5 \
        and hasattr(state, "speculate")
    seen = list(context) + list(new_ids)
    ahead: list[int] = []           # verified drafts, yielded before the next step
    while True:
        if token in stop:
            timing.stopped = True
            return
        timing.new_tokens += 1
        yield token
        seen.append(token)
        timing.decode_s = time.perf_counter() - start
        if timing.new_tokens == max_new_tokens or complete:
            timing.stopped = complete
            return
        if ahead:
            token = ahead.pop(0)
            continue
        drafts = drafter.draft(seen, max_new_tokens - timing.new_tokens - 1) \
            if speculating else []
        drafts = drafts[:next((i for i, t in enumerate(drafts) if t in stop), len(drafts))]
        if drafts:                  # fed: the drafts kept; not fed: the model's next token
            with torch.inference_mode():
                ahead = state.speculate(token, drafts)
            drafter.feedback(len(ahead) - 1, len(drafts))
            token = ahead.pop(0)
            continue
        with torch.inference_mode():
            token = pick(decode(token))
        timing.decode_s = time.perf_counter() - start


def _steps(model: HylaLM, state):
    """(prefill(ids) -> last logits, decode(token) -> logits) over ``state``."""
    if not isinstance(state, SequenceState):
        return state.prefill, state.decode
    device = model.anchor.device

    def prefill(ids: list[int]) -> torch.Tensor:
        return model.prefill(torch.tensor(ids, device=device), state)[-1]

    def decode(token: int) -> torch.Tensor:
        return model.decode(torch.tensor([token], device=device), [state])[0]
    return prefill, decode
