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

SPECULATIVE_METHODS = ("ngram",)


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


class NgramDrafter:
    """Drafts for one sequence (an engine request, or ``hyla generate``'s and ``hyla chat``'s
    stream, :func:`hyla.model.stream.stream_tokens`): :func:`ngram_drafts` of two tokens or
    more (one-token matches were mostly wrong on prose), up to ``k``.

    What a step's drafts cost when they fail sets two brakes. How many it drafts starts at
    one and grows to 3, then 7 (at most ``k``) while every draft is kept; a step that keeps
    none goes back to one: a verify of two tokens costs little more than a plain step, one
    of five (compiled: a width-8 batch) about 2.4 plain steps on SmolLM2. And after a step
    that keeps none it waits 1, 2, 4 ... 64 steps before drafting again.

    Example:
        >>> d = NgramDrafter(3)
        >>> d.draft([1, 2, 3, 4, 1, 2], room=8)       # one draft to begin with
        [3]
        >>> d.feedback(1, 1); d.draft([1, 2, 3, 4, 1, 2], room=8)
        [3, 4, 1]
        >>> d.feedback(0, 3); d.draft([1, 2, 3, 4, 1, 2], room=8)     # waits a step
        []
    """

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k, self.limit, self._wait, self._backoff = k, 1, 0, 0
        self.min_n = 2
        self.drafted = self.accepted = 0

    def draft(self, tokens: list[int], room: int) -> list[int]:
        if self._wait > 0:
            self._wait -= 1
            return []
        n = min(self.k, self.limit, room)
        return ngram_drafts(tokens, n, min_n=self.min_n) if n > 0 else []

    def feedback(self, accepted: int, drafted: int | None = None) -> None:
        """How many of the last ``drafted`` drafts the model kept."""
        self.accepted += accepted
        self.drafted += drafted or 0
        if accepted and accepted == drafted:
            self.limit = 2 * self.limit + 1
        if accepted:
            self._backoff = 0
        else:
            self.limit = 1
            self._backoff = min(2 * self._backoff or 1, 64)
            self._wait = self._backoff


class NgramSpeculator:
    """The engine's speculative steps: each request's :class:`NgramDrafter`, up to ``k``
    drafts a step."""

    def __init__(self, k: int):
        self.k = k
        self._drafters: dict[str, NgramDrafter] = {}

    def forget(self, request_id: str) -> None:
        self._drafters.pop(request_id, None)

    def step(self, engine, out) -> list | None:
        """A speculative step, where one request decodes alone: n-gram drafts verified in
        one forward, the drafts the model keeps (greedy: the agreeing prefix; sampled: by
        the speculative sampling rule, :func:`hyla.model.sampler.accept_drafts`) and the
        token after them. Drafts the model rejects were consumed by the recurrent states: those are
        restored and the kept tokens recomputed, so the state is exactly the one plain
        decoding would hold. None (a plain step follows) where it does not apply."""
        # (restores: a prompt one token past its cached prefix runs as a decode, and its
        # snapshot must be restored first: a plain step does that)
        if out.prefills or out.loads or out.restores or len(out.decodes) != 1:
            return None
        seq = out.decodes[0]
        p, n = seq.params, seq.num_computed_tokens
        if (p.logprobs is not None or p.grammar is not None or p.penalised or n == 0
                or seq.request_id in engine._prefill_only):
            return None
        r = engine.runner
        drafter = self._drafters.get(seq.request_id)
        if drafter is None:
            drafter = self._drafters[seq.request_id] = NgramDrafter(self.k)
            if r.fixed_shapes and not r.verifies_as_batch:
                # an eager verify against a compiled plain step: a miss costs about two
                # steps, so draft only after a 3-token match (SmolLM2 int4-a8: prose 0.88x
                # -> 1.02x, an edited function 1.14x -> 1.08x)
                drafter.min_n = 3
        room = min(p.max_tokens - len(seq.output_ids) - 1,
                   engine.scheduler.config.max_model_len - n - 1)
        drafts = drafter.draft(seq.all_token_ids, room)
        widths = engine.scheduler.config.decode_widths
        if r.verifies_as_batch:
            # verified as a decode batch (Runner.verify): a width costs the same whatever
            # share of its rows is real, and a wider one more, so keep what fills one
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
        kept = drafts[:j] + [after]
        drafter.feedback(j, len(drafts))
        engine.stats["decode_steps"] += 1
        engine.stats["decode_time_s"] += time.perf_counter() - t0
        engine.stats["draft_tokens"] += len(drafts)
        engine.stats["accepted_tokens"] += j
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
        engine.runner.copy_snapshots(out.snapshot_saves, save=True)
        return results
