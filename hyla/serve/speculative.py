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
    more (one-token matches were mostly wrong on prose), up to ``k``, and a back-off after a
    step whose drafts all failed: such a step costs about two plain ones (the verify, then
    the recompute), so it waits 1, 2, 4 ... 64 steps before drafting again.

    Example:
        >>> d = NgramDrafter(3)
        >>> d.draft([1, 2, 3, 4, 1, 2], room=8)
        [3, 4, 1]
        >>> d.feedback(0); d.draft([1, 2, 3, 4, 1, 2], room=8)     # waits a step
        []
    """

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k, self._wait, self._backoff = k, 0, 0
        self.drafted = self.accepted = 0

    def draft(self, tokens: list[int], room: int) -> list[int]:
        if self._wait > 0:
            self._wait -= 1
            return []
        return ngram_drafts(tokens, min(self.k, room), min_n=2) if room > 0 else []

    def feedback(self, accepted: int, drafted: int | None = None) -> None:
        """How many of the last drafts the model kept (a miss backs off 1, 2, 4 ... 64)."""
        self.accepted += accepted
        self.drafted += drafted or 0
        if accepted:
            self._backoff = 0
        else:
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
        drafter = self._drafters.setdefault(seq.request_id, NgramDrafter(self.k))
        room = min(p.max_tokens - len(seq.output_ids) - 1,
                   engine.scheduler.config.max_model_len - n - 1)
        drafts = drafter.draft(seq.all_token_ids, room)
        if not drafts or not engine.scheduler.reserve_ahead(seq, n + len(drafts) + 1):
            return None
        t0, r = time.perf_counter(), engine.runner
        saved = r.save_scratch(seq.slot)
        tokens = [seq.token_at(n)] + drafts
        logits = r.verify(seq.slot, tokens, n, seq.block_table)
        try:
            j, after = engine.verdict(logits, drafts, seq)
        except Exception as e:  # noqa: BLE001 - NaN logits, say: this request alone fails
            if saved:
                r.restore_scratch(seq.slot, saved)
            return [engine._fail(seq, None, e)]
        if j < len(drafts) and saved:   # fixed-size states consumed rejected drafts: go
            r.restore_scratch(seq.slot, saved)      # back (KV rows past the kept tokens are
            r.verify(seq.slot, tokens[:j + 1], n, seq.block_table)   # never read)
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
