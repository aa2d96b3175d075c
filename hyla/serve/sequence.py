"""A request's life in the engine: its sampling parameters and token bookkeeping.

Pure Python (no torch): the scheduler and the disaggregation simulator share it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    """How to pick and when to stop, per request (OpenAI's completion parameters).

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` switch those filters
    off. ``stop`` strings end the text (the engine checks them on the decoded text);
    ``stop_token_ids`` (and the tokenizer's EOS unless ``ignore_eos``) end on a token.
    ``logprobs``: also return the log-probability of each chosen token and of the
    ``logprobs`` most likely alternatives (0 = only the chosen one).

    Example:
        >>> SamplingParams(max_tokens=8, temperature=0).greedy
        True
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # owns a state slot (and KV blocks): prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: prompt, generated tokens, and where its state lives.

    ``num_computed_tokens`` counts the tokens of ``prompt_ids + output_ids`` already folded
    into the sequence's state; a step computes the rest (a prefill chunk, or the one newest
    token when decoding). ``slot`` is its StatePool slot and ``block_table`` its KV blocks
    (attention layers), both owned by the scheduler. ``external_state`` carries a state
    prefilled elsewhere (disaggregated prefill) until the engine loads it into the slot.

    Example:
        >>> s = Sequence("r1", [5, 6, 7], SamplingParams(max_tokens=2))
        >>> s.num_tokens, s.num_prompt_tokens, s.status.value
        (3, 3, 'waiting')
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None    # "stop", "length" or "abort"
    external_state: object | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt must hold at least one "
                             "token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute: the (rest of the) prompt, or a recompute."""
        return self.num_tokens - self.num_computed_tokens > 1

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def stop_reason_for(self, token: int) -> str | None:
        """Why the sequence ends after appending ``token`` (None: it goes on)."""
        p = self.params
        if not p.ignore_eos and token == self.eos_token_id:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= p.max_tokens:
            return "length"
        return None
