"""Structured output: a request's grammar as a token mask applied to its logits each step.

Grammars are compiled by `llguidance <https://github.com/guidance-ai/llguidance>`_ (the
engine llama.cpp and vLLM use too), picked over XGrammar for what ``benchmarks/
structured_output.py`` measured on SmolLM2's 49,152-token vocabulary: both compile all 30
test schemas (llguidance in at most 2 ms, XGrammar 15 ms) and compute a token's mask in
7-93 us (XGrammar 0.7-5 us), both far below the 10%-of-decode target, but llguidance
installs alone (XGrammar requires ``transformers`` and ``triton``), reads the ``tokenizers``
JSON every hyla tokenizer has, and takes GBNF and Lark grammars. Schemas are checked and
closed first (:mod:`hyla.serve.json_schema`).

- :class:`GrammarCompiler`: a :class:`~hyla.serve.sequence.GrammarSpec` -> a validated
  llguidance matcher (its parser: building one takes up to seconds for a big schema), kept
  by spec (least recently used dropped first); each request gets a copy of it (microseconds,
  so the engine's thread never builds one the API compiled). A schema or grammar that is
  invalid, unsatisfiable or recursive without a base case is a ValueError naming it.
- :class:`MaskBatch`: the masks of one step's constrained rows, computed on a worker
  thread while the model runs, then applied to the logits.

Example:
    >>> from hyla.data.tokenizer import ByteTokenizer
    >>> from hyla.serve.sequence import GrammarSpec
    >>> gc = GrammarCompiler(ByteTokenizer(), vocab_size=256, stop_ids=[0])
    >>> m = gc.matcher(GrammarSpec("regex", "ab"))
    >>> m.consume_token(ord("a")), m.consume_token(ord("b")), m.is_accepting()
    (True, True, True)
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hyla.serve.json_schema import closed, parse_schema
from hyla.serve.sequence import GrammarSpec

# JSON as models write it (json.dumps' separators), with no free whitespace a small model
# could fill until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1000         # llguidance's rows hold 2,000 items: more choices fail to parse


def tokenizers_json(tokenizer) -> str:
    """The ``tokenizers`` JSON of a hyla tokenizer (byte, BPE/transformers, tiktoken)."""
    from hyla.data.tokenizer import BPETokenizer, ByteTokenizer
    from hyla.model.formats.hf.tokenizer import byte_tokenizer_json, hf_form

    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer_json().to_str()
    form = hf_form(tokenizer)
    if isinstance(form, BPETokenizer):
        return form.backend.to_str()
    raise ValueError(f"structured output needs a byte, BPE or tiktoken tokenizer, got "
                     f"{type(tokenizer).__name__}")


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary; thread-safe (the API compiles off its
    event loop, the engine looks up the same cache)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], *,
                 cache_size: int = 64):
        import llguidance

        stop_ids = list(stop_ids) or [0]       # as Constraints: byte 0 for the byte tokenizer
        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizers_json(tokenizer), n_vocab=vocab_size,
                                                eos_token=list(stop_ids))
        self.vocab_size = vocab_size
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """The matcher of ``spec`` in its start state, kept for copies (ValueError naming
        the problem when the grammar is invalid)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        template = self._ll.LLMatcher(self.tokenizer, build_grammar(spec), log_level=0)
        # a grammar whose first step already exceeds the parser's limits fails here, not
        # at the request's first token
        probe = template.deep_copy()
        mask = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        if not template.is_error():
            probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        for m in (template, probe):
            if m.is_error():
                raise ValueError(f"the {_noun(spec)} is invalid: "
                                 f"{m.get_error().strip().splitlines()[0][:300]}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: GrammarSpec):
        """A fresh parser state (``llguidance.LLMatcher``) for one request: a copy of the
        compiled one."""
        return self.compile(spec).deep_copy()


def check_grammar(spec: GrammarSpec) -> None:
    """ValueError naming what is wrong with ``spec``, before any model or tokenizer is at
    hand (``hyla chat --json-schema`` checks its file before loading the model)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(build_grammar(spec), None)
    if error:
        raise ValueError(f"the {_noun(spec)} is invalid: {error.strip().splitlines()[0][:300]}")


def build_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec`` (ValueError when it cannot be one)."""
    import llguidance as ll

    text = spec.source
    if spec.kind == "json_schema":
        schema = closed(parse_schema(text))
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(text)
    if spec.kind == "lark":
        return ll.LLMatcher.grammar_from_lark(text)
    if spec.kind == "choice":
        try:
            choices = json.loads(text)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, str) and c for c in choices):
            raise ValueError("the list of choices is invalid: expected a JSON list of "
                             "non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"the list of choices is too long: {len(choices)}, at most "
                             f"{MAX_CHOICES} (a JSON schema enum takes more)")
    try:
        return ll.grammar_from(spec.kind, text)        # "grammar" (GBNF or Lark), "choice"
    except ValueError as e:
        raise ValueError(f"the {_noun(spec)} is invalid: {e}") from None


def _noun(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "regex": "regular expression",
            "choice": "list of choices"}.get(spec.kind, "grammar")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits [n, V] of tokens whose bit is 0 in ``bitmask`` [n, ceil(V / 32)]
    (int32, bit ``t % 32`` of word ``t // 32`` for token ``t``) to -inf, in place."""
    V = logits.shape[1]
    # numpy's unpackbits: 30x faster than shifting a [n, V / 32, 32] tensor on a CPU
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    blocked = torch.from_numpy(bits[:, :V]).to(logits.device) == 0
    logits.masked_fill_(blocked, float("-inf"))


class MaskBatch:
    """The masks of one step's constrained rows: :meth:`start` before the model runs, then
    :meth:`apply` to its logits (waits for the worker if it is still computing)."""

    def __init__(self, vocab_size: int):
        self._words = (vocab_size + 31) // 32
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hyla-grammar")
        self._future: Future | None = None
        self._ids: list[str] = []

    def start(self, matchers: dict[str, object]) -> None:
        """Compute a mask for each request id -> matcher (in the worker thread)."""
        self._ids = list(matchers)
        self._future = (self._worker.submit(self._compute, list(matchers.values()))
                        if matchers else None)

    def _compute(self, matchers: list) -> torch.Tensor:
        masks = torch.full((len(matchers), self._words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(masks[i].data_ptr(), self._words * 4)
        return masks

    def apply(self, logits: torch.Tensor, row_of: dict[str, int]) -> None:
        """Mask the rows ``row_of[request id]`` of ``logits`` for the ids :meth:`start` had
        (an id with no row this step, a chunk that samples nothing, is skipped)."""
        if self._future is None:
            return
        masks, self._future = self._future.result(), None
        keep = [(i, row_of[rid]) for i, rid in enumerate(self._ids) if rid in row_of]
        if not keep:
            return
        rows = torch.tensor([r for _, r in keep])
        sub = logits[rows].float()
        apply_bitmask(sub, masks[[i for i, _ in keep]].to(sub.device))
        logits[rows] = sub.to(logits.dtype)

    def close(self) -> None:
        self._worker.shutdown(wait=False)


class Constraints:
    """The engine's grammar state: one matcher a constrained request, the compiler made on
    the first grammar (it needs the tokenizer), and the step's masks.

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> from hyla.serve.sequence import GrammarSpec
        >>> c = Constraints(ByteTokenizer(), vocab_size=256, stop_ids=[0])
        >>> c.add("r", GrammarSpec("regex", "hi"))
        >>> logits = torch.zeros(1, 256)
        >>> c.start(["r"]); c.apply(logits, ["r"])
        >>> int(logits.argmax()), c.consume("r", ord("h")), c.done("r")
        (104, None, False)
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        # a tokenizer with no end-of-text token (hyla's byte one): byte 0 ends a grammar
        self.stop_ids = tuple(stop_ids) or (0,)
        self._args = (tokenizer, vocab_size, self.stop_ids)
        self._compiler: GrammarCompiler | None = None
        self._masks: MaskBatch | None = None
        self.matchers: dict[str, object] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            tokenizer, vocab, stops = self._args
            if tokenizer is None:
                raise ValueError("grammar: structured output needs a tokenizer (this engine "
                                 "is token-only)")
            self._compiler = GrammarCompiler(tokenizer, vocab, stops)
            self._masks = MaskBatch(vocab)
        return self._compiler

    def add(self, request_id: str, spec: GrammarSpec) -> None:
        self.matchers[request_id] = self.compiler.matcher(spec)

    def start(self, request_ids: Sequence[str]) -> None:
        """Begin the masks of this step's sampling requests that have a grammar."""
        if self.matchers:
            self._masks.start({r: self.matchers[r] for r in request_ids if r in self.matchers})

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None:
        """Mask ``logits`` (row i: ``request_ids[i]``) with the masks :meth:`start` began."""
        if self._masks is not None:
            self._masks.apply(logits, {r: i for i, r in enumerate(request_ids)})

    def consume(self, request_id: str, token: int) -> str | None:
        """Advance a request's grammar by its sampled token; why it cannot (a rejected
        token, or a grammar that failed: then its output is not complete), or None."""
        m = self.matchers.get(request_id)
        if m is None:
            return None
        if m.consume_token(token) and not m.is_error():
            return None
        why = (m.get_error() or "not allowed here").strip().splitlines()[0][:300]
        return f"the grammar failed at token {token}: {why}"

    def done(self, request_id: str) -> bool:
        """Whether the request's grammar is complete and admits nothing more."""
        m = self.matchers.get(request_id)
        return m is not None and m.is_stopped()

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)


class TokenConstraint:
    """One generation's grammar for a plain sampling loop
    (:func:`hyla.model.stream.stream_tokens`, ``hyla chat --json-schema``): :meth:`mask`
    the logits [V] (or [1, V]) before each draw, :meth:`accept` the drawn token; ValueError
    if the grammar is invalid or the token breaks it.

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> gc = GrammarCompiler(ByteTokenizer(), vocab_size=256, stop_ids=[0])
        >>> c = TokenConstraint(gc, GrammarSpec("regex", "ok"))
        >>> logits = torch.zeros(256); c.mask(logits); int(logits.argmax())
        111
        >>> c.accept(ord("o")), c.accept(ord("k"))
        (False, True)
    """

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec):
        self._matcher = compiler.matcher(spec)
        self._mask = torch.full((1, (compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), self._mask.numel() * 4)
        row = logits.view(1, -1)
        apply_bitmask(row, self._mask)

    def accept(self, token: int) -> bool:
        """Feed ``token``; True when the grammar is complete (nothing more may follow)."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            why = self._matcher.get_error().strip().splitlines()[:1]
            raise ValueError(f"the grammar failed at token {token}: {''.join(why)[:300]}")
        return self._matcher.is_stopped()
