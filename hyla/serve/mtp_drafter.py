"""Draft tokens from a model's own multi-token-prediction layers (``--speculative mtp``;
:mod:`hyla.model.mtp`): no second model, and drafts that see the target's hidden states.

The runner that computes the target keeps every row's final hidden state in a
:class:`~hyla.serve.hidden_log.HiddenLog`. Before each draft the sequence's
:class:`MTPDrafter` feeds its MTP state the pairs it has not seen (the target's hidden state
at each new position and the token after it), then drafts: the first draft from the last
pair, each further one by running the MTP layer on its own output and the draft before.
The drafts' rows are then taken back (the state keeps only pairs the target computed), so
whatever the target rejects, the MTP state never holds a wrong pair; the target's output is
its own either way.

Example:
    >>> import torch
    >>> from hyla.model import HylaLM
    >>> from hyla.model.config import HylaConfig
    >>> from hyla.serve.session import RunnerState
    >>> cfg = HylaConfig(vocab_size=64, d_model=32, layers="GA", n_heads=4, ffn_dim=64,
    ...                  mtp_layers=1)
    >>> model = HylaLM(cfg).eval()
    >>> state, d = RunnerState(model), MTPDrafter(model, 3)
    >>> d.attach(state.keep_hidden(), 0)
    >>> _ = state.prefill([5, 6, 7, 8])      # the target computed 4 positions
    >>> len(d.draft([5, 6, 7, 8, 9], room=8)), d.state.num_tokens  # one, to begin with
    (1, 4)
    >>> d.feedback(1, 1); len(d.draft([5, 6, 7, 8, 9], room=8))    # all kept: k
    3
"""

from __future__ import annotations

import torch

from hyla.model import HylaLM
from hyla.model.mtp import MTPState
from hyla.serve.hidden_log import HiddenLog
from hyla.serve.speculative import BackOff


def check_mtp(model: HylaLM) -> None:
    """ValueError unless ``model`` has MTP layers to draft with."""
    if getattr(model, "mtp", None) is None:
        raise ValueError("--speculative mtp: this model has no multi-token-prediction layers "
                         "(a checkpoint that ships them has: Qwen3-Next's and Qwen3.5's mtp.*, "
                         "MiMo-V2-Flash's model.mtp.* tensors, which transformers' "
                         "save_pretrained leaves out; "
                         "hyla.train.mtp_head trains one for any model); use --speculative "
                         "ngram or draft:SOURCE")


class MTPDrafter(BackOff):
    """Drafts for one sequence from ``model.mtp``: up to ``k`` greedy tokens under
    :class:`BackOff`'s brakes (one to begin with, more while all are kept, a wait after a
    verify that keeps none), stopping before one whose probability under the head is below
    ``confidence`` (0: never). Its MTP state grows with the
    sequence; where the log lacks positions it has not seen (it keeps the last 4096 at
    least: a request that decoded in a batch for longer, or one whose prompt was prefilled
    elsewhere) it starts again from what the log holds. ``batches`` False: the engine
    drafts only for a request decoding alone."""

    batches = False
    needs_hidden = True         # attach() it to the log of the runner computing the target

    def __init__(self, model: HylaLM, k: int, *, confidence: float = 0.0):
        check_mtp(model)
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.model, self.k, self.confidence = model, k, confidence
        self.log: HiddenLog | None = None
        self.slot = 0
        self.state: MTPState | None = None
        self.upto = 0               # the state holds the pairs of positions [base, upto)
        self._g = None              # the MTP output at position upto - 1

    def attach(self, log: HiddenLog, slot: int) -> None:
        """Read the target's hidden states from ``log``'s ``slot`` (a new place: start
        again)."""
        if log is not self.log or slot != self.slot:
            self.state = None
        self.log, self.slot = log, slot

    @torch.inference_mode()
    def draft(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``k`` tokens (fewer under the brakes, at most ``room``) after ``tokens``
        (the sequence; the target has computed all but the last)."""
        most = self.most(self.k, room)
        if most <= 0 or self.log is None or len(tokens) < 2:
            return []
        if self.waiting():
            return []
        g = self._catch_up(tokens)
        if g is None:
            return []
        st, n = self.state, len(tokens) - 1
        head, vocab = self.model.lm_head, self.model.cfg.vocab_size
        drafts: list[int] = []
        while True:
            logits = head(g[None])[0]
            token = int(logits.argmax())
            if token >= vocab or self.confidence > 0 and float(
                    torch.softmax(logits.float(), dim=-1)[token]) < self.confidence:
                break
            drafts.append(token)
            if len(drafts) == most:
                break
            g = st.run([token], g[None])[-1]
        st.truncate(n - st.base)        # the drafts' rows: taken back
        if not drafts:
            self.unsure()
        return drafts

    def _catch_up(self, tokens: list[int]):
        """Feed the pairs of positions up to the last computed one; its MTP output (None:
        the log does not hold the sequence's hidden states)."""
        n = len(tokens) - 1
        first, end = self.log.span(self.slot)
        if end < n:
            return None
        st = self.state
        if st is None or not first <= self.upto <= n:
            self.state, self.upto, self._g = MTPState(self.model, first), first, None
            st = self.state
        if self.upto < n:
            g = st.run(tokens[self.upto + 1:n + 1], self.log.rows(self.slot, self.upto, n))
            self.upto, self._g = n, g[-1]
        return self._g

    def state_bytes(self) -> int:
        """The bytes its MTP state holds (0 before its first draft)."""
        return self.state.nbytes() if self.state is not None else 0

    def close(self) -> None:
        """The request ended: its slot's hidden states go too."""
        if self.log is not None:
            self.log.clear(self.slot)
        self.state = None
