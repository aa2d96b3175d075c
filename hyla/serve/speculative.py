"""Draft tokens for speculative decoding by n-gram lookup in the sequence itself (prompt
lookup decoding): where the last few tokens occurred before, guess that what followed them
then follows now. Free to compute, and right often on repetitive work (editing code,
quoting the prompt). Pure Python: the engine's runner does the torch side.

The engine (:meth:`hyla.serve.engine.Engine.step`) verifies the drafts in one forward and
keeps the longest prefix the model agrees with (sampled: the drafts the speculative sampling
rule keeps), plus the model's own next token; a recurrent state that consumed rejected
drafts is restored and recomputed, so the output is the model's greedy output (sampled: its
distribution).

Example:
    >>> ngram_drafts([1, 2, 3, 4, 9, 1, 2, 3], 3)
    [4, 9, 1]
    >>> ngram_drafts([5, 6, 7], 2)
    []
"""

from __future__ import annotations

import time

SPECULATIVE_METHODS = ("ngram", "mtp", "draft:SOURCE")


def check_speculative(method: str | None) -> None:
    """ValueError naming the choices when ``method`` is not a speculative method.

    Example:
        >>> check_speculative("draft:smollm2"); check_speculative("eagle")
        Traceback (most recent call last):
        ...
        ValueError: --speculative: expected one of ('ngram', 'mtp', 'draft:SOURCE'), got 'eagle'
    """
    if method is not None and method not in ("ngram", "mtp") and not method.startswith("draft:"):
        raise ValueError(f"--speculative: expected one of {SPECULATIVE_METHODS}, got "
                         f"{method!r}")


def ngram_drafts(tokens: list[int], k: int, *, max_n: int = 3, min_n: int = 1,
                 window: int = 4096) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_n`` down to ``min_n``; the longest match wins), looked for
    in its last ``window`` tokens. Empty when nothing matches."""
    if k <= 0:
        return []
    seq = tokens[-window:]
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        # the latest occurrence that is not the tail itself
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


class BackOff:
    """What drafters share: how many drafts they made and how many were kept, and two brakes
    on drafts that fail (an unrelated draft model made a small model 6.6x slower without
    them; a weak MTP head cost 13%):

    - how many a step drafts (:meth:`most`) starts at one and grows to 3, then 7 (at most
      ``k``) while every draft is kept; a step that keeps none goes back to one: a verify
      of two tokens costs little more than a plain step, one of five (compiled: a width-8
      batch) about 2.4 plain steps on SmolLM2, and each draft of a model or an MTP head
      costs its own forward and ``lm_head``;
    - after a step that keeps none, or one whose drafter was too unsure to draft, it
      waits 1, 2, 4 ... 64 plain steps before drafting again."""

    drafted = accepted = 0
    _wait = _backoff = 0
    limit = 1

    def waiting(self) -> bool:
        """Whether this step waits (one step of the wait counted off)."""
        if self._wait > 0:
            self._wait -= 1
            return True
        return False

    def most(self, k: int, room: int) -> int:
        """How many tokens this step may draft: ``k`` and ``room`` capped by the ramp."""
        return min(k, self.limit, room)

    def feedback(self, accepted: int, drafted: int | None = None) -> None:
        """How many of the last ``drafted`` drafts the model kept."""
        self.accepted += accepted
        self.drafted += drafted or 0
        if accepted:
            self._backoff = 0
            if accepted == drafted:
                self.limit = 2 * self.limit + 1
        elif drafted:
            self.unsure()
            self.limit = 1

    def unsure(self) -> None:
        """Wait before drafting again: after a verify that keeps none, or a step with no
        draft sure enough to make (its draft forward and ``lm_head`` were paid for nothing:
        a weak MTP head tried every step made SmolLM2 14% slower)."""
        self._backoff = min(2 * self._backoff or 1, 64)
        self._wait = self._backoff


class NgramDrafter(BackOff):
    """Drafts for one sequence (an engine request, or ``hyla generate``'s and ``hyla chat``'s
    stream, :func:`hyla.model.stream.stream_tokens`): :func:`ngram_drafts` of two tokens or
    more (one-token matches were mostly wrong on prose), up to ``k``.

    It drafts under :class:`BackOff`'s brakes: one token to begin with, more while all are
    kept, a wait after a step that keeps none.

    Example:
        >>> d = NgramDrafter(3)
        >>> d.draft([1, 2, 3, 4, 1, 2], room=8)       # one draft to begin with
        [3]
        >>> d.feedback(1, 1); d.draft([1, 2, 3, 4, 1, 2], room=8)
        [3, 4, 1]
        >>> d.feedback(0, 3); d.draft([1, 2, 3, 4, 1, 2], room=8)     # waits a step
        []
    """

    batches = True                  # free to draft: for every request of a decode batch

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k, self.min_n = k, 2

    def draft(self, tokens: list[int], room: int) -> list[int]:
        if self.waiting():
            return []
        n = self.most(self.k, room)
        return ngram_drafts(tokens, n, min_n=self.min_n) if n > 0 else []


class Speculator:
    """The engine's speculative steps: each request's drafter (``new_drafter()``; default an
    :class:`NgramDrafter`), up to ``k`` drafts a step. A drafter class whose ``batches`` is
    False drafts only for a request decoding alone."""

    def __init__(self, k: int, new_drafter=None):
        self.k = k
        self.new_drafter = new_drafter or (lambda: NgramDrafter(k))
        self._drafters: dict = {}

    def forget(self, request_id: str) -> None:
        drafter = self._drafters.pop(request_id, None)
        if drafter is not None and hasattr(drafter, "close"):
            drafter.close()

    def state_bytes(self) -> int:
        """The bytes the running requests' drafters hold (an MTP head's states; n-gram
        drafters hold none)."""
        return sum(d.state_bytes() for d in self._drafters.values() if hasattr(d, "state_bytes"))

    def step(self, engine, out) -> list | None:
        """A speculative step: n-gram drafts verified in one forward, the drafts the model
        keeps (greedy: the agreeing prefix; sampled: by the speculative sampling rule,
        :func:`hyla.model.sampler.accept_drafts`) and the token after them. One request
        decoding alone, on any runner; several, where the runner verifies drafts as a decode
        batch (:attr:`~hyla.serve.runner.Runner.verifies_as_batch`: no fixed-size state),
        all their rows in one batch. Drafts the model rejects were consumed by the recurrent
        states: those are restored and the kept tokens recomputed, so the state is exactly
        the one plain decoding would hold. None (a plain step follows) where it does not
        apply."""
        # (restores: a prompt one token past its cached prefix runs as a decode, and its
        # snapshot must be restored first: a plain step does that)
        if out.prefills or out.loads or out.restores or not out.decodes:
            return None
        r = engine.runner
        seqs = out.decodes
        if len(seqs) > 1 and not (r.verifies_as_batch and self._drafter(r, seqs[0]).batches):
            return None
        for seq in seqs:
            p = seq.params
            if (p.logprobs is not None or p.grammar is not None or p.penalised
                    or seq.num_computed_tokens == 0 or seq.request_id in engine._prefill_only):
                return None
        if len(seqs) == 1:
            return self._one(engine, out, seqs[0])
        return self._batch(engine, out, seqs)

    def _drafter(self, r, seq):
        drafter = self._drafters.get(seq.request_id)
        if drafter is None:
            drafter = self._drafters[seq.request_id] = self.new_drafter()
            if isinstance(drafter, NgramDrafter) and r.fixed_shapes and not r.verifies_as_batch:
                # an eager verify against a compiled plain step: a miss costs about two
                # steps, so draft only after a 3-token match (SmolLM2 int4-a8: prose 0.88x
                # -> 1.02x, an edited function 1.14x -> 1.08x)
                drafter.min_n = 3
        return drafter

    def _drafts(self, engine, seq, most: int | None = None) -> list[int]:
        n = seq.num_computed_tokens
        room = min(seq.params.max_tokens - len(seq.output_ids) - 1,
                   engine.scheduler.config.max_model_len - n - 1, self.k if most is None else most)
        drafter = self._drafter(engine.runner, seq)
        if getattr(drafter, "needs_hidden", False):     # MTP: the target's hidden states
            drafter.attach(engine.runner.hidden_log, seq.slot)
        return drafter.draft(seq.all_token_ids, room)

    def _one(self, engine, out, seq) -> list | None:
        r, n = engine.runner, seq.num_computed_tokens
        widths = engine.scheduler.config.decode_widths
        # verified as a decode batch (Runner.verify): a width costs the same whatever share
        # of its rows is real, and a wider one more, so draft no more than k fill
        most = max((w for w in widths if w <= self.k + 1), default=1) - 1 \
            if r.verifies_as_batch else self.k
        drafts = self._drafts(engine, seq, most)
        if r.verifies_as_batch:     # keep what fills a width
            fill = max((w for w in widths if w <= len(drafts) + 1), default=1)
            drafts = drafts[:fill - 1]
        if not drafts or not engine.scheduler.reserve_ahead(seq, n + len(drafts) + 1):
            return None
        t0 = time.perf_counter()
        saved = r.save_scratch(seq.slot)
        tokens = [seq.token_at(n)] + drafts
        logits = r.verify(seq.slot, tokens, n, seq.block_table, widths)
        try:
            j, after = engine.verdict(logits, drafts, seq)
        except Exception as e:  # noqa: BLE001 - NaN logits, say: this request alone fails
            if saved:
                r.restore_scratch(seq.slot, saved)
            return [engine._fail(seq, None, e)]
        if j < len(drafts) and saved:   # fixed-size states consumed rejected drafts: go
            r.restore_scratch(seq.slot, saved)      # back (KV rows past the kept tokens are
            r.verify(seq.slot, tokens[:j + 1], n, seq.block_table, widths)  # never read)
        self._drafter(r, seq).feedback(j, len(drafts))
        results = self._keep(engine, out, seq, drafts, j, after)
        self._count(engine, t0, len(drafts), j)
        engine.runner.copy_snapshots(out.snapshot_saves, save=True)
        return results

    def _batch(self, engine, out, seqs) -> list | None:
        """Several decoding requests' drafts verified in one decode batch: each request's
        rows at consecutive positions (the runner's mixers all grow per token, so no state
        is rolled back: rows past the kept tokens are never read). Drafts are cut, latest
        requests' first, to the width that holds them all where that is :meth:`_worth` it
        (else to the plain step's width: its spare rows are free), at most the widest."""
        r, sched = engine.runner, engine.scheduler
        widths = sched.config.decode_widths
        drafts = [self._drafts(engine, seq) for seq in seqs]
        plain = next(w for w in widths if w >= len(seqs))
        wide = next((w for w in widths if w >= len(seqs) + sum(map(len, drafts))), widths[-1])
        if wide > plain and not self._worth(r, seqs, drafts, plain, wide):
            wide = plain                # only the plain step's spare rows: free
        for i in range(len(seqs) - 1, -1, -1):
            over = len(seqs) + sum(map(len, drafts)) - wide
            if over > 0:
                drafts[i] = drafts[i][:max(0, len(drafts[i]) - over)]
        for i, seq in enumerate(seqs):
            if drafts[i] and not sched.reserve_ahead(
                    seq, seq.num_computed_tokens + len(drafts[i]) + 1):
                drafts[i] = []
        width = next(w for w in widths if w >= len(seqs) + sum(map(len, drafts)))
        if not any(drafts) or not r.runs_graph(width):
            return None
        t0 = time.perf_counter()
        rows = [(seq.slot, [seq.token_at(seq.num_computed_tokens)] + d,
                 seq.num_computed_tokens, seq.block_table)
                for seq, d in zip(seqs, drafts, strict=True)]
        parts = r.verify_batch(rows, widths)
        results, drafted, kept = [], 0, 0
        for seq, d, logits in zip(seqs, drafts, parts, strict=True):
            try:
                j, after = engine.verdict(logits, d, seq)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                results.append(engine._fail(seq, None, e))
                continue
            if d:
                self._drafter(r, seq).feedback(j, len(d))
            results += self._keep(engine, out, seq, d, j, after)
            drafted, kept = drafted + len(d), kept + j
        self._count(engine, t0, drafted, kept)
        engine.runner.copy_snapshots(out.snapshot_saves, save=True)
        return results

    def _worth(self, r, seqs, drafts, plain: int, wide: int) -> bool:
        """Whether a step of width ``wide`` (all the drafts) is expected to give more tokens
        a second than the plain one: each request's drafts kept at its rate so far (a
        draft is kept with probability p, the next only after it: p + p^2 + ...), against
        the two widths' measured step times (not known yet: no)."""
        t_plain, t_wide = r.width_seconds.get(plain), r.width_seconds.get(wide)
        if t_plain is None or t_wide is None:
            return False
        tokens = len(seqs)
        for seq, d in zip(seqs, drafts, strict=True):
            drafter = self._drafters[seq.request_id]
            p = (drafter.accepted + 1) / (drafter.drafted + 2)
            tokens += sum(p ** m for m in range(1, len(d) + 1))
        return tokens / t_wide > len(seqs) / t_plain

    def _keep(self, engine, out, seq, drafts, j, after) -> list:
        """The kept drafts and the token after them, emitted in order (up to a stop)."""
        kept = drafts[:j] + [after]
        results = []
        for i, token in enumerate(kept):
            finished = engine.scheduler.advance(seq, token, out, snapshot=i == len(kept) - 1)
            engine.stats["generation_tokens"] += 1
            try:
                results.append(engine._emit(seq, token, None, finished))
            except Exception as e:  # noqa: BLE001 - this request's output failed
                results.append(engine._fail(seq, token, e))
            if seq.is_finished:
                break
        return results

    def _count(self, engine, t0: float, drafted: int, kept: int) -> None:
        engine.stats["decode_steps"] += 1
        engine.stats["decode_time_s"] += time.perf_counter() - t0
        engine.stats["draft_tokens"] += drafted
        engine.stats["accepted_tokens"] += kept
