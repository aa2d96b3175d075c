"""Draft tokens for speculative decoding from a smaller (or quantised) model that shares the
target's tokenizer (``--speculative draft:SOURCE``): the draft model decodes a few greedy
tokens ahead on its own state, the target verifies them in one forward, and the output stays
the target's own.

Each sequence's :class:`ModelDrafter` keeps the draft model's state in a one-slot
:class:`~hyla.serve.session.RunnerState` (``hyla generate`` and ``hyla chat``) or in a slot
of the engine's shared :class:`DraftSlots` (``hyla serve``). After a verify, the tokens it
fed that the target rejected are taken back: attention rows by moving the length back (rows
past it are overwritten), a fixed-size recurrent state by restoring the copy taken before
the drafts.
Drafting can stop early at a token the draft model is unsure of (its probability under
``confidence``; transformers' assisted generation stops under 0.4, llama.cpp under 0.75): a
draft that is likely wrong costs a verify row and a draft step for nothing. The default is
0: SmolLM2 quantised to int4 drafting for itself in float had 90-100% of its drafts kept,
and stopping under 0.4 made it 8-13% slower (fewer drafts a verify, more verifies).

Example:
    >>> from hyla.model import HylaLM, preset
    >>> draft = HylaLM(preset("debug")).eval()
    >>> d = ModelDrafter(draft, 3)
    >>> len(d.draft([1, 2, 3, 4], room=8)), d.state.num_tokens    # one, to begin with
    (1, 4)
    >>> d.feedback(1, 1)                                    # all kept: up to k a step
    >>> len(d.draft([1, 2, 3, 4, 5], room=8)), d.state.num_tokens  # fed 5 tokens + 2 drafts
    (3, 7)
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hyla.model import HylaLM
from hyla.serve.runner import Runner
from hyla.serve.session import RunnerState
from hyla.serve.speculative import BackOff

DRAFT_PREFIX = "draft:"
PROBE_TEXT = "def main():\n    print('Hello, world!')  # café 2026"


class SlotState:
    """One sequence's state in a slot of a shared :class:`Runner` (a :class:`DraftSlots`
    slot): ``prefill``, ``decode`` and ``num_tokens`` as a :class:`RunnerState` has them, its
    KV in the consecutive blocks ``first, first + 1, ...``."""

    def __init__(self, runner: Runner, slot: int, first_block: int, chunk: int = 512):
        self.runner, self.slot, self.first, self.chunk = runner, slot, first_block, chunk
        self.num_tokens = 0
        runner.reset_slot(slot)

    def _table(self, tokens: int) -> list[int]:
        if not self.runner.has_growing:
            return []
        return list(range(self.first, self.first + -(-tokens // self.runner.block_size)))

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        logits = None
        for at in range(0, len(ids), self.chunk):
            part, start = list(ids[at:at + self.chunk]), self.num_tokens
            logits = self.runner.prefill([(self.slot, part, start,
                                           self._table(start + len(part)))])
            self.num_tokens += len(part)
        return logits[0]

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        pos = self.num_tokens
        logits = self.runner.decode([self.slot], [int(token)], [pos], [self._table(pos + 1)],
                                    width=1)
        self.num_tokens += 1
        return logits[0]


class DraftSlots:
    """The draft model's states for an engine's requests: one :class:`Runner` (compiled
    where the engine's is) of ``slots`` slots, each with KV blocks for ``max_model_len``
    tokens, lent least recently used first. A drafter whose slot was lent to another
    request starts again from its whole sequence (a prefill of the draft model), so memory
    stays ``slots`` sequences however many requests speculate."""

    def __init__(self, model: HylaLM, *, max_model_len: int, slots: int = 2,
                 block_size: int = 16, compile: bool = False,
                 kv_dtype: torch.dtype | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        growing = any(spec.per_token for spec in model.state_specs)
        self.blocks_per_slot = -(-max_model_len // block_size) if growing else 0
        self.max_model_len = max_model_len
        self.runner = Runner(model, max_num_seqs=slots, block_size=block_size,
                             num_kv_blocks=slots * self.blocks_per_slot, compile=compile,
                             kv_dtype=kv_dtype, eager_until_built=compile)
        self._owner: OrderedDict[int, object] = OrderedDict()   # slot -> drafter, LRU first
        self._free = list(range(slots))

    def lend(self, drafter) -> SlotState:
        """A fresh slot for ``drafter``: a free one, else the least recently used one's."""
        slot = self._free.pop() if self._free else next(iter(self._owner))
        old = self._owner.pop(slot, None)
        if old is not None:
            old.state = None            # starts again on its next draft
        self._owner[slot] = drafter
        return SlotState(self.runner, slot, slot * self.blocks_per_slot)

    def touch(self, state: SlotState) -> None:
        self._owner.move_to_end(state.slot)

    def give_back(self, state: SlotState) -> None:
        if self._owner.pop(state.slot, None) is not None:
            self._free.append(state.slot)

    def warmup(self) -> int:
        """Build the one-row decode graph (compiled runners; else nothing)."""
        if not self.runner.fixed_shapes:
            return 0
        return self.runner.warmup((1,), self.blocks_per_slot)


class ModelDrafter(BackOff):
    """Drafts for one sequence from ``model``: up to ``k`` greedy tokens, stopping before one
    whose probability is under ``confidence``, backing off after drafts that all fail.
    ``batches`` False: the engine runs it only for a request decoding alone (each request's
    draft steps would run one after another)."""

    batches = False

    def __init__(self, model: HylaLM, k: int, *, confidence: float = 0.0,
                 slots: DraftSlots | None = None, vocab: int | None = None):
        """``slots``: where its state lives (an engine's shared :class:`DraftSlots`; None: a
        one-slot :class:`RunnerState` of its own). ``vocab``: the target's vocabulary size
        (drafting stops at a token past it: a draft's vocabulary may be padded wider)."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.model, self.k, self.confidence, self.slots = model, k, confidence, slots
        self.vocab = vocab if vocab is not None else model.cfg.vocab_size
        self.state: RunnerState | SlotState | None = None
        self.fixed = any(spec.fixed for spec in model.state_specs)
        self.fed: list[int] = []            # the tokens the draft state holds
        self._saved, self._saved_at = None, -1  # fixed-size state before the last drafts

    @torch.inference_mode()
    def draft(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``k`` tokens (fewer under the brakes, at most ``room``) the draft model
        expects after ``tokens`` (the whole sequence so far, its last token not yet
        verified)."""
        n = self.most(self.k, room)
        if n <= 0 or not tokens:
            return []
        if self.waiting():          # (the state catches up on the next draft)
            return []
        logits = self._sync(tokens)
        drafts: list[int] = []
        while True:
            if self.confidence > 0:
                p, token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
                if float(p) < self.confidence:
                    break
            else:
                token = logits.argmax()
            if int(token) >= self.vocab:
                break
            drafts.append(int(token))
            if len(drafts) == n:
                break
            logits = self.state.decode(drafts[-1])
            self.fed.append(drafts[-1])
        if not drafts:
            self.unsure()
        return drafts

    def close(self) -> None:
        """Give the state's slot back (the request ended)."""
        if self.slots is not None and self.state is not None:
            self.slots.give_back(self.state)
        self.state = None

    def _fresh_state(self):
        self.fed, self._saved, self._saved_at = [], None, -1
        return RunnerState(self.model) if self.slots is None else self.slots.lend(self)

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        """Make the draft state hold exactly ``tokens``; the logits after the last."""
        if self.state is None:
            self.state = self._fresh_state()
        elif self.slots is not None:
            self.slots.touch(self.state)
        common = 0
        limit = min(len(self.fed), len(tokens) - 1)     # the last is fed for its logits
        while common < limit and self.fed[common] == tokens[common]:
            common += 1
        if common < len(self.fed):
            self._take_back(common)
        new = tokens[len(self.fed):]
        compiled = self.slots is not None and self.slots.runner.runs_graph(1)
        if len(new) == 1 or (len(new) == 2 and compiled):     # cheaper as decode steps
            for t in new:
                logits = self.state.decode(t)
        else:
            logits = self.state.prefill(new)
        self.fed = list(tokens)
        if self.fixed:
            self._saved = self.state.runner.save_scratch(self._slot())
            self._saved_at = len(tokens)
        return logits

    def _slot(self) -> int:
        return getattr(self.state, "slot", 0)

    def _take_back(self, keep: int) -> None:
        """Go back to holding the first ``keep`` tokens fed."""
        if self.fixed:
            if self._saved is None or self._saved_at > keep:
                self.close()                # nothing to go back to: start again
                self.state = self._fresh_state()
                return
            self.state.runner.restore_scratch(self._slot(), self._saved)
            keep = self._saved_at
        self.state.num_tokens = keep
        del self.fed[keep:]


def tokenizer_difference(draft_tok, target_tok) -> str | None:
    """What tells two tokenizers apart (None: nothing found): a probe text's ids, the
    special ids, a rendered chat turn, then each id's text up to the smaller vocabulary."""
    a, b = draft_tok.encode(PROBE_TEXT), target_tok.encode(PROBE_TEXT)
    if a != b:
        return f"it encodes {PROBE_TEXT!r} as {a[:12]}..., the target as {b[:12]}..."
    for attr in ("bos_id", "eos_id", "stop_ids"):
        x, y = getattr(draft_tok, attr, None), getattr(target_tok, attr, None)
        if x is not None and y is not None and x != y:
            return f"its {attr} is {x}, the target's {y}"
    turn = [{"role": "user", "content": "hi"}]
    try:
        x = draft_tok.apply_chat_template(turn, tokenize=True)
        y = target_tok.apply_chat_template(turn, tokenize=True)
    except Exception:  # noqa: BLE001 - no chat template (either side): nothing to compare
        x = y = None
    if x != y:
        return f"it renders a chat turn as {list(x)[:12]}..., the target as {list(y)[:12]}..."
    n = min(getattr(draft_tok, "vocab_size", 0), getattr(target_tok, "vocab_size", 0))
    for i in range(n):
        x, y = draft_tok.decode([i]), target_tok.decode([i])
        if x != y:
            return f"its token {i} is {x!r}, the target's {y!r}"
    return None


def check_draft_vocab(draft: HylaLM, draft_tok, target: HylaLM, target_tok,
                      source: str = "") -> None:
    """ValueError naming what differs when ``draft`` cannot draft for ``target``: its tokens
    must mean the target's (:func:`tokenizer_difference` finds nothing) and fit in the
    target's vocabulary."""
    flag = f"--speculative draft:{source}"
    if target_tok is not None and draft_tok is not None:
        why = tokenizer_difference(draft_tok, target_tok)
        if why is not None:
            raise ValueError(f"{flag}: the draft model's tokenizer differs from the target's "
                             f"({why}): a draft model must share the target's tokenizer")
    elif draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"{flag}: the draft model's vocabulary has {draft.cfg.vocab_size} "
                         f"tokens, the target's {target.cfg.vocab_size}, and there is no "
                         f"tokenizer to compare")


def load_draft(source: str, target: HylaLM, target_tok) -> HylaLM:
    """The draft model of ``draft:SOURCE`` (any :func:`hyla.model.load_model` source) on the
    target's device and in its dtype, checked against the target's tokenizer
    (:func:`check_draft_vocab`); quantising it is the caller's (``--draft-quantize``)."""
    from hyla.model.load import load_model

    source = source.strip()
    if not source:
        raise ValueError("--speculative draft:SOURCE needs a model after 'draft:' (a hyla "
                         "or transformers checkpoint directory, a GGUF file, or a known name "
                         "such as smollm2)")
    try:
        model, tok = load_model(source, device=str(target.anchor.device))
    except (OSError, ValueError) as e:
        raise ValueError(f"--speculative draft:{source}: {e}") from e
    model = model.to(target.anchor.dtype).eval()
    check_draft_vocab(model, tok, target, target_tok, source)
    return model


def model_drafters(config, target: HylaLM, tokenizer, draft: HylaLM | None):
    """(draft model, its :class:`DraftSlots`, what makes each request's drafter) for an
    engine's ``config`` (:class:`~hyla.serve.engine.EngineConfig`): all None unless its
    ``speculative`` is ``draft:SOURCE`` (``draft`` None: SOURCE loaded here, unquantised)
    or ``mtp`` (the target's own MTP layers: the drafter alone).
    The slots: two sequences' worth (a request decoding alone drafts; the slot of one that
    waits its turn long enough goes to the next), compiled where the engine is."""
    c = config
    if c.speculative == "mtp":
        from hyla.serve.mtp_drafter import MTPDrafter, check_mtp

        check_mtp(target)
        return None, None, lambda: MTPDrafter(target, c.num_speculative_tokens,
                                              confidence=c.draft_confidence)
    if not (c.speculative or "").startswith(DRAFT_PREFIX):
        return None, None, None
    if draft is None:
        draft = load_draft(c.speculative[len(DRAFT_PREFIX):], target, tokenizer)
    slots = DraftSlots(draft, max_model_len=c.max_model_len, block_size=c.block_size,
                       compile=c.compile)
    return draft, slots, lambda: ModelDrafter(
        draft, c.num_speculative_tokens, confidence=c.draft_confidence, slots=slots,
        vocab=target.cfg.vocab_size)
