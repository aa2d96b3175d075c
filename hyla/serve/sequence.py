"""A request's life in the engine: its sampling parameters and token bookkeeping.

Pure Python (no torch): the scheduler and the disaggregation simulator share it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy (the sampler's threshold, kept here because this module
# imports no torch): dividing logits by a near-zero temperature would overflow to inf.
GREEDY_BELOW = 1e-5
MAX_STOP = 16                 # stop strings a request may give (OpenAI allows 4)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


GRAMMAR_KINDS = ("json_schema", "regex", "grammar", "lark", "choice")
MAX_GRAMMAR_CHARS = 64 * 1024      # a schema or grammar a client sends: larger is refused
MAX_BUILT_GRAMMAR_CHARS = 1 << 20  # one hyla builds from parts (many tools' schemas)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured output): ``kind`` is ``json_schema``
    (``source`` the schema as JSON text), ``regex``, ``grammar`` (GBNF, as llama.cpp
    writes it, or Lark), ``lark`` or ``choice`` (a JSON list of strings). Compiled by
    :mod:`hyla.serve.structured`; hashable, so compiled grammars are cached by it.

    Example:
        >>> GrammarSpec("regex", "[0-9]+").kind
        'regex'
    """

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"the {self.kind} must be a non-empty string")
        if len(self.source) > MAX_BUILT_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind} is too large: {len(self.source)} characters, "
                             f"at most {MAX_BUILT_GRAMMAR_CHARS}")


@dataclass(kw_only=True)
class SamplingParams:
    """How to pick and when to stop, per request (OpenAI's completion parameters).

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` switch those filters
    off. ``stop`` strings end the text (the engine checks them on the decoded text);
    ``stop_token_ids`` (and the tokenizer's EOS unless ``ignore_eos``) end on a token.
    ``logprobs``: also return the log-probability of each chosen token and of the
    ``logprobs`` most likely alternatives (0 = only the chosen one). ``prompt_logprobs``:
    the same for every prompt token after the first (vLLM's field; computed in prefill,
    chunk by chunk); with it ``max_tokens`` may be 0 (score the prompt alone).
    ``grammar``: the output must match it (a :class:`GrammarSpec`); tokens it rules out are
    masked before sampling. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in
    [-2, 2]) lower the logit of each token already in the output by the first once and the
    second per occurrence; ``repetition_penalty`` (vLLM's, > 0, 1 = off) divides positive
    logits and multiplies negative ones of tokens in the prompt or output by it.

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
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Every field is checked for type, finiteness and range here, so that nothing a
        # client sends can reach the sampler as NaN, inf or an out-of-range value: a bad
        # value is a ValueError naming the field (HTTP 400), never an engine failure.
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got "
                             f"{self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1    # 0: score the prompt alone
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            raise ValueError(f"max_tokens must be an int >= {least}, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:   # NaN fails the range too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(2 ** 63) <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                             "characters each")
        for s in self.stop:     # a lone surrogate (JSON's "\ud800") never matches text
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"stop: {s[e.start:e.end]!r} at character {e.start} cannot "
                                 f"be encoded as UTF-8 ({e.reason})") from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                not _is_int(t) or not 0 <= t < 2 ** 63 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ints >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:     # NaN fails the range too
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        # below 0.01 a float32 logit divided by it overflows to inf
        if not _is_real(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be a number in [0.01, 100], got "
                             f"{self.repetition_penalty!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    def as_dict(self) -> dict:
        """Its fields as JSON values (the grammar as a dict): what a worker is sent."""
        d = dict(self.__dict__)
        if self.grammar is not None:
            d["grammar"] = {"kind": self.grammar.kind, "source": self.grammar.source}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """:meth:`as_dict`'s inverse; ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"params must be an object, got {type(d).__name__}")
        grammar = d.get("grammar")
        if grammar is not None:
            if not isinstance(grammar, dict) or set(grammar) != {"kind", "source"}:
                raise ValueError('params.grammar must be {"kind": ..., "source": ...}')
            d = {**d, "grammar": GrammarSpec(**grammar)}
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"params: {e}") from None

    @property
    def penalised(self) -> bool:
        """Whether a penalty changes its logits (they then depend on the tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` (the sampler's threshold) pick the argmax."""
        return self.temperature < GREEDY_BELOW


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


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
    end_ids: tuple[int, ...] = ()       # other ids that end it like EOS (generation_config)
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
    # The request it belongs to, for fair scheduling: the prompts of one batch request
    # share it (None: a request of its own).
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt must hold at least one "
                             "token")

    @property
    def fair_group(self) -> str:
        """What the scheduler shares slots and turns between: the request (a batch's
        prompts are one)."""
        return self.group if self.group is not None else self.request_id

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
        if not p.ignore_eos and (token == self.eos_token_id or token in self.end_ids):
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= p.max_tokens:
            return "length"
        return None
