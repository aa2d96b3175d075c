"""Continuous batching: which sequences compute which tokens in the next engine step.

Pure Python (no torch), so the disaggregation simulator runs these exact decisions.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first:
decoding ones (one token each), then those still in their prompt get their next chunk
(chunked prefill) in turns across requests: the first prefilling sequence of each request
in admission order, then the second of each, and so on (the prompts of one batch request
are one request: :attr:`Sequence.fair_group`). Then waiting sequences are admitted while a
state slot, KV blocks and budget remain, the request with the fewest running sequences
first (first come, first served between equals), and a request with none running that
finds no free slot takes one from the request holding the most (its newest sequence is
preempted): a small request beside a batch of hundreds of prompts waits for neither the
whole batch nor a free slot. The prefix cache may cover the start of a prompt. When a
running sequence needs a KV block and none is free, the most
recently admitted sequence is preempted: its slot and blocks are freed and it is recomputed
later from its tokens (prompt and output so far), in front of the queue.

Decode batches are padded up to the next of ``decode_widths``, so a compiled decode step
only ever sees those batch sizes.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from hyla.serve.block_manager import BlockManager
from hyla.serve.prefix_cache import PrefixCache, block_hashes, extend_hashes
from hyla.serve.sequence import Sequence, SequenceStatus
from hyla.serve.state_pool import StatePool

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def decode_widths(max_num_seqs: int) -> tuple[int, ...]:
    """The default widths up to ``max_num_seqs``: 1, 2, 4, 8, 16, 24, 32, 48, 64, then
    steps of 32, always ending at ``max_num_seqs``.

    Example:
        >>> decode_widths(20)
        (1, 2, 4, 8, 16, 20)
        >>> decode_widths(128)[-3:]
        (64, 96, 128)
    """
    widths = [w for w in DEFAULT_WIDTHS if w < max_num_seqs]
    w = 96
    while w < max_num_seqs:
        widths.append(w)
        w += 32
    return (*widths, max_num_seqs)


@dataclass(kw_only=True)
class SchedulerConfig:
    """Engine capacity. ``num_kv_blocks == 0`` means the model has no attention layers;
    ``num_state_snapshots == 0`` turns GLA prefix snapshots off (or there are no GLA
    layers); ``enable_prefix_caching`` turns the whole prefix cache on or off."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 0
    decode_widths: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    num_state_snapshots: int = 0
    snapshot_interval: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_widths is None:
            self.decode_widths = decode_widths(self.max_num_seqs)
        widths = tuple(sorted(set(self.decode_widths)))
        if not widths or widths[0] < 1 or widths[-1] < self.max_num_seqs:
            raise ValueError(f"decode_widths must be positive and reach max_num_seqs "
                             f"({self.max_num_seqs}), got {self.decode_widths}")
        self.decode_widths = widths


@dataclass
class PrefillChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``seq.all_token_ids``."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the sequence's last token (a token gets sampled)."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One engine step. ``restores``: (snapshot slot, state slot) copies to do before
    computing; ``loads``: sequences whose ``external_state`` must be loaded into their
    slot first; ``snapshot_saves`` (filled by ``update``): (state slot, snapshot slot)
    copies to do after it."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    decode_width: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    loads: list[Sequence] = field(default_factory=list)
    snapshot_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Continuous-batching scheduler over a StatePool, a BlockManager and a PrefixCache.

    Example:
        >>> from hyla.serve.sequence import SamplingParams
        >>> s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8))
        >>> s.add(Sequence("a", list(range(10)), SamplingParams(max_tokens=1)))
        >>> out = s.schedule(); [(c.start, c.num_tokens) for c in out.prefills]
        [(0, 8)]
        >>> s.update(out, {})
        []
        >>> out = s.schedule(); [(c.start, c.num_tokens) for c in out.prefills]
        [(8, 2)]
        >>> [q.finish_reason for q in s.update(out, {"a": 7})]
        ['length']
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pool = StatePool(config.max_num_seqs)
        self.blocks = (BlockManager(config.num_kv_blocks, config.block_size)
                       if config.num_kv_blocks else None)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(config.block_size, self.blocks,
                                            config.num_state_snapshots, config.snapshot_interval)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._hashes: dict[str, list[int]] = {}
        self._rolling: dict[str, int] = {}      # request id -> its rolling snapshot's boundary
        self.num_preemptions = 0
        # states shipped from a cached prefix on (PrfaaS): loaded after it, or (evicted
        # meanwhile) computed here
        self.shipped_prefix_hits = self.shipped_prefix_misses = 0

    # -- queue -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size could never run."""
        c = self.config
        if num_prompt_tokens + max_tokens > c.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the context length {c.max_model_len}")
        if self.blocks is not None:
            need = self.blocks.blocks_for(num_prompt_tokens + max_tokens)
            if need > self.blocks.num_blocks:
                raise ValueError(f"the request needs {need} KV blocks, the engine has "
                                 f"{self.blocks.num_blocks}")

    def add(self, seq: Sequence) -> None:
        """Queue a sequence. One that arrives prefilled (``num_computed_tokens`` equal to its
        prompt, one output token, ``external_state`` set) goes straight to decoding."""
        self.check(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free what it holds."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, "abort")
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._finish(seq, "abort")
                return seq
        return None

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        counts = Counter(s.fair_group for s in self.running)
        order = self._running_order()           # the decoding ones, then the prefilling
        decoding = sum(1 for s in order if not s.is_prefilling)
        budget = self._run(order[:decoding], budget, out)
        if max(counts.values(), default=0) > 1:
            # A batch is running: a request with nothing running is admitted before the
            # batch's prefill chunks take the budget (else it waits for all of them).
            budget = self._admit_waiting(budget, out, counts, only_new=True)
        budget = self._run(order[decoding:], budget, out)
        self._admit_waiting(budget, out, counts)
        if out.decodes:
            widths = self.config.decode_widths
            out.decode_width = widths[bisect.bisect_left(widths, len(out.decodes))]
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advance the sequences of ``out`` after the runner computed them. ``sampled``
        holds one token per sequence whose last token was computed (decodes, and prefill
        chunks reaching the end); returns the sequences that finished."""
        finished = []
        for seq in out.decodes:
            seq.num_computed_tokens += 1
            self._cache_decoded(seq, out)
        for chunk in out.prefills:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            self._cache_prefix(seq, out)
        for seq in [*out.decodes, *(c.seq for c in out.prefills if c.samples)]:
            if seq.is_finished:        # aborted meanwhile
                continue
            token = sampled[seq.request_id]
            seq.output_ids.append(token)
            reason = seq.stop_reason_for(token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def reserve_ahead(self, seq: Sequence, upto: int) -> bool:
        """KV blocks for ``seq`` to hold ``upto`` tokens if they are free now (speculative
        decoding's drafts): never by preempting; False when they are not."""
        if self.blocks is None:
            return True
        need = self.blocks.blocks_for(upto) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_table += self.blocks.allocate(
            need, after=seq.block_table[-1] if seq.block_table else None)
        return True

    def advance(self, seq: Sequence, token: int, out: SchedulerOutput, *,
                snapshot: bool = True) -> bool:
        """One more computed token and one more output ``token`` for a decoding sequence,
        as :meth:`update` does for a decode step (speculative decoding accepts several a
        step: ``snapshot`` False where the runner's state is not at this token, so the
        rolling snapshot is not taken there). Returns whether the sequence finished."""
        seq.num_computed_tokens += 1
        self._cache_decoded(seq, out, snapshot=snapshot)
        seq.output_ids.append(token)
        reason = seq.stop_reason_for(token)
        if reason is not None:
            self.finish(seq, reason)
            return True
        return False

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence (``reason``: "stop", "length"), freeing its slot/blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, reason)

    # -- internals ---------------------------------------------------------------------
    def _run(self, seqs: list[Sequence], budget: int, out: SchedulerOutput) -> int:
        """Schedule running ``seqs`` in order while budget remains; returns what is left."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq not in self.running:
                continue        # preempted to make room for an earlier one this step
            n = self._chunk_len(seq, budget)
            if not self._reserve_kv(seq, seq.num_computed_tokens + n, out):
                continue        # seq itself was preempted
            if n == 1 and not seq.is_prefilling:
                out.decodes.append(seq)
            else:
                out.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, out: SchedulerOutput, counts: Counter,
                       only_new: bool = False) -> int:
        """Admit waiting sequences while a slot, KV blocks and budget remain, the request
        with the fewest running first; ``only_new``: only requests with none running."""
        while self.waiting and budget > 0 and not out.preempted:
            seq = self._next_waiting(counts)
            if only_new and counts[seq.fair_group]:
                break
            if self.pool.num_free == 0 and counts[seq.fair_group] == 0:
                self._take_a_slot(counts, out)
            if not self._admit(seq, budget, out):
                break
            self.waiting.remove(seq)
            counts[seq.fair_group] += 1
            self.running.append(seq)
            chunk_tokens = seq.num_tokens - seq.num_computed_tokens
            n = self._chunk_len(seq, budget)
            if chunk_tokens == 1:
                out.decodes.append(seq)
            else:
                out.prefills.append(PrefillChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _running_order(self) -> list[Sequence]:
        """Decoding sequences (admission order), then prefilling ones in turns across
        requests: each request's first, then each one's second, ..."""
        decoding = [s for s in self.running if not s.is_prefilling]
        turn: Counter = Counter()
        ranked = []
        for i, s in enumerate(self.running):
            if s.is_prefilling:
                ranked.append((turn[s.fair_group], i, s))
                turn[s.fair_group] += 1
        return decoding + [s for _, _, s in sorted(ranked, key=lambda r: r[:2])]

    def _next_waiting(self, counts: Counter) -> Sequence:
        """The waiting sequence of the request with the fewest running sequences (the
        earliest in the queue between equals)."""
        best = None
        for seq in self.waiting:
            n = counts[seq.fair_group]
            if best is None or n < best[0]:
                best = (n, seq)
                if n == 0:
                    break
        return best[1]

    def _take_a_slot(self, counts: Counter, out: SchedulerOutput) -> None:
        """Preempt the newest sequence of the request holding the most slots (when it holds
        more than one), for a request that holds none."""
        if not counts:
            return
        group, n = max(counts.items(), key=lambda kv: kv[1])
        if n < 2:
            return
        victim = next(s for s in reversed(self.running) if s.fair_group == group)
        self._preempt(victim, out)
        counts[group] -= 1

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        pc = self.prefix_cache
        if pc is not None and n > 1:
            # Stop at the next GLA snapshot boundary so the state there can be saved.
            b = pc.next_boundary(seq.num_computed_tokens, seq.num_tokens)
            if b is not None:
                n = min(n, b - seq.num_computed_tokens)
        return n

    def _reserve_kv(self, seq: Sequence, upto: int, out: SchedulerOutput) -> bool:
        """Make ``seq``'s block table cover ``upto`` tokens, preempting the newest running
        sequences if blocks run out. False if ``seq`` itself was preempted."""
        if self.blocks is None:
            return True
        need = self.blocks.blocks_for(upto) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.blocks.allocate(
                need, after=seq.block_table[-1] if seq.block_table else None)
        return True

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Give a waiting sequence a slot, its prefix-cache hit and KV blocks for its first
        chunk; False (nothing taken) if they are not available."""
        if self.pool.num_free == 0:
            return False
        match = None
        # A request that asks for its prompt's logprobs computes the whole prompt (a cached
        # prefix has no logits to give), as vLLM does; it still fills the cache for others.
        if (self.prefix_cache is not None and seq.external_state is None
                and seq.num_computed_tokens == 0
                and getattr(seq.params, "prompt_logprobs", None) is None):
            match = self.prefix_cache.match(seq.all_token_ids)
            if match.num_tokens == 0:
                match = None
        prefix = None
        # (the simulator marks a shipped state with True: a whole one)
        if getattr(seq.external_state, "start", 0):
            prefix = self._shipped_prefix(seq)
            if prefix is None:      # evicted since the router looked: computed here instead
                seq.external_state = None
                seq.num_computed_tokens = 0
                self.shipped_prefix_misses += 1
                return self._admit(seq, budget, out)
            self.shipped_prefix_hits += 1
        start = match.num_tokens if match else seq.num_computed_tokens
        if self.blocks is not None:
            shared = match.kv_blocks if match else prefix or []
            if seq.external_state is not None:
                upto = seq.num_tokens
            else:
                upto = start + min(seq.num_tokens - start, budget)
            need = self.blocks.blocks_for(upto) - len(shared)
            # Shared blocks sitting in the free queue count as free until we take them.
            revived = sum(1 for b in shared if self.blocks.ref_count[b] == 0)
            if not self.blocks.can_allocate(need + revived):
                return False
            for b in shared:
                self.blocks.share(b)
            seq.block_table = list(shared) + self.blocks.allocate(
                need, after=shared[-1] if shared else None)
        seq.slot = self.pool.allocate()
        seq.status = SequenceStatus.RUNNING
        if self.prefix_cache is not None and seq.external_state is None:
            self.prefix_cache.record(seq.num_tokens, match.num_tokens if match else 0)
        if match is not None:
            seq.num_computed_tokens = seq.num_cached_tokens = match.num_tokens
            if match.snapshot is not None:
                out.restores.append((match.snapshot, seq.slot))
        if seq.external_state is not None:
            out.loads.append(seq)
            if self.prefix_cache is not None and self.blocks is not None:
                # the loaded prompt's blocks join the cache (loaded before any step reads
                # them), so the next turn of its conversation hits here
                full = seq.num_prompt_tokens // self.config.block_size
                self.prefix_cache.insert_blocks(self._hashes_of(seq)[:full],
                                                seq.block_table[:full])
        return True

    def _shipped_prefix(self, seq: Sequence) -> list[int] | None:
        """The cached KV blocks of the prefix a state shipped from ``start`` on leaves out
        (None: not all cached, or ``start`` not on a block boundary)."""
        start = seq.external_state.start
        if self.blocks is None:
            return []           # no growing state: nothing was left out
        if self.prefix_cache is None or start % self.config.block_size:
            return None
        return self.prefix_cache.kv_blocks(seq.prompt_ids[:start])

    def _cache_prefix(self, seq: Sequence, out: SchedulerOutput) -> None:
        pc = self.prefix_cache
        if pc is None:
            return
        hashes = self._hashes_of(seq)
        n = seq.num_computed_tokens
        full = min(n // self.config.block_size, len(hashes))
        pc.insert_blocks(hashes[:full], seq.block_table[:full])
        if n <= seq.num_prompt_tokens and pc.is_snapshot_boundary(n, seq.num_prompt_tokens):
            snap = pc.save_snapshot(hashes[n // self.config.block_size - 1])
            if snap is not None:
                out.snapshot_saves.append((seq.slot, snap))

    def _hashes_of(self, seq: Sequence) -> list[int]:
        """The chained hashes of ``seq``'s full blocks known so far (its prompt's at first;
        :meth:`_cache_decoded` extends them over its output)."""
        hashes = self._hashes.get(seq.request_id)
        if hashes is None:
            hashes = self._hashes[seq.request_id] = block_hashes(seq.prompt_ids,
                                                                 self.config.block_size)
        return hashes

    def _cache_decoded(self, seq: Sequence, out: SchedulerOutput, *,
                       snapshot: bool = True) -> None:
        """A decoded token that fills a block past the prompt: the block joins the cache
        and (with ``snapshot``) the sequence's rolling snapshot moves to its end."""
        pc, bs, n = self.prefix_cache, self.config.block_size, seq.num_computed_tokens
        if pc is None or n % bs or n <= seq.num_prompt_tokens or seq.slot is None:
            return
        hashes = extend_hashes(self._hashes_of(seq), seq.all_token_ids[:n], bs)
        block = seq.block_table[n // bs - 1] if len(seq.block_table) >= n // bs else None
        if block is not None:
            pc.insert_blocks([hashes[n // bs - 1]], [block])
        if not snapshot:
            return
        snap = pc.move_snapshot(self._rolling.get(seq.request_id), hashes[n // bs - 1])
        if snap is not None:
            self._rolling[seq.request_id] = hashes[n // bs - 1]
            out.snapshot_saves.append((seq.slot, snap))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        for chunk in list(out.prefills):
            if chunk.seq is seq:
                out.prefills.remove(chunk)
        if seq in out.decodes:
            out.decodes.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.pool.free(seq.slot)
            seq.slot = None
        if self.blocks is not None and seq.block_table:
            self.blocks.free(seq.block_table)
        seq.block_table = []

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        self._hashes.pop(seq.request_id, None)
        self._rolling.pop(seq.request_id, None)     # its snapshot stays in the cache
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
