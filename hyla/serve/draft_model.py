"""Draft tokens for speculative decoding from a smaller (or quantised) model that shares the
target's tokenizer (``--speculative draft:SOURCE``): the draft model decodes a few greedy
tokens ahead on its own state, the target verifies them in one forward, and the output stays
the target's own.

Each sequence's :class:`ModelDrafter` keeps the draft model's state in a one-slot
:class:`~hyla.serve.session.RunnerState`. After a verify, the tokens it fed that the target
rejected are taken back: attention rows by moving the length back (rows past it are
overwritten), a fixed-size recurrent state by restoring the copy taken before the drafts.
Drafting stops early at a token the draft model is unsure of (its probability under
``confidence``), as transformers' assisted generation does: a draft that is likely wrong
costs a verify row and a draft step for nothing.

Example:
    >>> from hyla.model import HylaLM, preset
    >>> draft = HylaLM(preset("debug")).eval()
    >>> d = ModelDrafter(draft, 3, confidence=0.0)
    >>> len(d.draft([1, 2, 3, 4], room=8)), d.state.num_tokens    # fed 4 tokens + 2 drafts
    (3, 6)
"""

from __future__ import annotations

import torch

from hyla.model import HylaLM
from hyla.serve.session import RunnerState

DRAFT_PREFIX = "draft:"
PROBE_TEXT = "def main():\n    print('Hello, world!')  # café 2026"


class ModelDrafter:
    """Drafts for one sequence from ``model``: up to ``k`` greedy tokens, stopping before one
    whose probability is under ``confidence``. ``batches`` False: the engine runs it only for
    a request decoding alone (each request's draft steps would run one after another)."""

    batches = False

    def __init__(self, model: HylaLM, k: int, *, confidence: float = 0.4):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.model, self.k, self.confidence = model, k, confidence
        self.state: RunnerState | None = None
        self.fixed = any(spec.fixed for spec in model.state_specs)
        self.fed: list[int] = []            # the tokens the draft state holds
        self._saved, self._saved_at = None, -1  # fixed-size state before the last drafts
        self.drafted = self.accepted = 0

    @torch.inference_mode()
    def draft(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``min(k, room)`` tokens the draft model expects after ``tokens`` (the whole
        sequence so far, its last token not yet verified)."""
        n = min(self.k, room)
        if n <= 0 or not tokens:
            return []
        logits = self._sync(tokens)
        drafts: list[int] = []
        while True:
            probs = torch.softmax(logits.float(), dim=-1)
            p, token = probs.max(dim=-1)
            if float(p) < self.confidence:
                break
            drafts.append(int(token))
            if len(drafts) == n:
                break
            logits = self.state.decode(drafts[-1])
            self.fed.append(drafts[-1])
        return drafts

    def feedback(self, accepted: int, drafted: int | None = None) -> None:
        """How many of the last ``drafted`` drafts the target kept (counted; what the draft
        state must take back is found from the next call's tokens)."""
        self.accepted += accepted
        self.drafted += drafted or 0

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        """Make the draft state hold exactly ``tokens``; the logits after the last."""
        if self.state is None:
            self.state = RunnerState(self.model)
        common = 0
        limit = min(len(self.fed), len(tokens) - 1)     # the last is fed for its logits
        while common < limit and self.fed[common] == tokens[common]:
            common += 1
        if common < len(self.fed):
            self._take_back(common)
        logits = self.state.prefill(tokens[len(self.fed):])
        self.fed = list(tokens)
        if self.fixed:
            self._saved, self._saved_at = self.state.runner.save_scratch(0), len(tokens)
        return logits

    def _take_back(self, keep: int) -> None:
        """Go back to holding the first ``keep`` tokens fed."""
        if self.fixed:
            if self._saved is None or self._saved_at > keep:
                self.state, self.fed = RunnerState(self.model), []  # nothing to go back to
                return
            self.state.runner.restore_scratch(0, self._saved)
            keep = self._saved_at
        self.state.num_tokens = keep
        del self.fed[keep:]


def check_draft_vocab(draft: HylaLM, draft_tok, target: HylaLM, target_tok) -> None:
    """ValueError naming what differs when ``draft`` cannot draft for ``target``: its tokens
    must mean the target's (the two tokenizers encode a probe text alike) and fit in the
    target's vocabulary."""
    if target_tok is not None and draft_tok is not None:
        a, b = draft_tok.encode(PROBE_TEXT), target_tok.encode(PROBE_TEXT)
        if a != b:
            raise ValueError(f"--speculative draft: the draft model's tokenizer differs from "
                             f"the target's (it encodes {PROBE_TEXT!r} as {a[:12]}..., the "
                             f"target as {b[:12]}...): a draft model must share the target's "
                             f"tokenizer")
    elif draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"--speculative draft: the draft model's vocabulary has "
                         f"{draft.cfg.vocab_size} tokens, the target's "
                         f"{target.cfg.vocab_size}, and there is no tokenizer to compare")
    if draft.cfg.vocab_size > target.cfg.vocab_size and target_tok is None:
        raise ValueError(f"--speculative draft: the draft model's vocabulary "
                         f"({draft.cfg.vocab_size}) is larger than the target's "
                         f"({target.cfg.vocab_size})")


def load_draft(source: str, target: HylaLM, target_tok) -> HylaLM:
    """The draft model of ``draft:SOURCE`` (any :func:`hyla.model.load_model` source) on the
    target's device and in its dtype, checked against the target's tokenizer
    (:func:`check_draft_vocab`); quantising it is the caller's (``--draft-quantize``)."""
    from hyla.model.load import load_model

    if not source:
        raise ValueError("--speculative draft:SOURCE needs a model after 'draft:' (a "
                         "checkpoint directory, a GGUF or safetensors file, or a known name "
                         "such as smollm2)")
    model, tok = load_model(source, device=str(target.anchor.device))
    model = model.to(target.anchor.dtype).eval()
    check_draft_vocab(model, tok, target, target_tok)
    return model
