"""The step loop: scheduler decides, runner computes, sampler picks, outputs stream out.

``Engine`` is synchronous (``add_request`` / ``step`` / ``generate``); ``AsyncEngine`` in
:mod:`hyla.serve.async_engine` runs it on a background thread for the HTTP server.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hyla.model.model import HylaLM
from hyla.model.sampler import TokenLogprob, accept_drafts, sample
from hyla.ops.hardware import fast_low_precision_matmul
from hyla.serve.detokenizer import IncrementalText
from hyla.serve.draft_model import model_drafters
from hyla.serve.hidden_log import HiddenLog
from hyla.serve.penalties import apply_penalties
from hyla.serve.runner import Runner
from hyla.serve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hyla.serve.sequence import SamplingParams, Sequence
from hyla.serve.speculative import Speculator, check_speculative
from hyla.serve.structured import Constraints


@dataclass(kw_only=True)
class EngineConfig:
    """Engine capacity and behaviour.

    ``num_kv_blocks`` defaults to enough blocks for ``max_num_seqs`` full-length sequences
    (attention layers only); ``num_state_snapshots`` to 8 a slot within 256 MiB, at least
    one a slot (fixed-size states only).
    ``compile``: run decode through ``torch.compile`` (``--eager`` turns it off).
    ``cuda_graphs``: replay each fixed decode shape as a captured CUDA graph (CUDA only;
    :meth:`Engine.warmup` captures them all before serving).
    ``kv_cache_dtype``: the paged KV blocks' dtype: None or ``"auto"`` the model's (bfloat16
    when the model is, or its weights are quantised), ``"float32"``/``"bfloat16"`` or a torch
    dtype (:func:`kv_dtype_for`).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    # Bytes the paged KV blocks may take (``num_kv_blocks`` from it): at least one
    # full-length sequence, at most what max_num_seqs full-length ones need. None: the most.
    kv_cache_memory: int | None = None
    kv_cache_dtype: torch.dtype | str | None = None
    enable_prefix_caching: bool = True
    num_state_snapshots: int | None = None
    # Bytes the prefix cache's state snapshots may take (``num_state_snapshots`` from it, at
    # least one; least recently used evicted first). None: ``num_state_snapshots``.
    prefix_cache_memory: int | None = None
    snapshot_interval: int = 256
    decode_widths: tuple[int, ...] | None = None
    compile: bool = False
    # with compile: decode runs eagerly until warmup() has built each width's graph (a
    # server warms up in the background and serves meanwhile)
    eager_until_compiled: bool = False
    cuda_graphs: bool = False
    # speculative decoding of up to num_speculative_tokens a step: "ngram" (drafts by
    # n-gram lookup in the sequence itself; for several requests decoding together too),
    # "mtp" (the model's own MTP layers) or "draft:SOURCE" (a draft model sharing the
    # tokenizer; these two for a request decoding alone)
    speculative: str | None = None
    num_speculative_tokens: int = 4
    # draft:SOURCE and mtp draft no token the drafter gives a probability under this (0: k
    # drafts a step; hyla.serve.draft_model says why)
    draft_confidence: float = 0.0
    # logits [B, V], per-row params and generators -> (tokens, logprobs); the same sampler
    # as hyla.model.generate by default
    sampler: Callable = sample


KV_DTYPES = ("auto", "float32", "bfloat16")
# the prefix cache's state snapshots by default (EngineConfig.prefix_cache_memory sets it)
DEFAULT_SNAPSHOT_BYTES = 256 << 20


def kv_dtype_for(model: HylaLM, choice: torch.dtype | str | None) -> torch.dtype:
    """The KV blocks' dtype for ``choice`` (:attr:`EngineConfig.kv_cache_dtype`): None or
    ``"auto"`` the model's (as vLLM's ``auto``: outputs exactly the model's; a model served
    in bfloat16, as ``hyla serve --dtype auto`` does on CUDA, caches bfloat16), but bfloat16
    under quantised weights (``--quantize``: outputs are no longer the float model's anyway;
    llama.cpp caches f16 by default); a name in :data:`KV_DTYPES` or a dtype. ``"bfloat16"``
    under an fp32 model halves the cache's bytes (prompt logprobs within ~2e-3) and the
    bytes a compiled wide decode step's attention reads. Where bf16 products are emulated
    (CPUs without AVX512-BF16 or AMX), ``auto`` keeps the model's dtype under quantised
    weights too.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> m = HylaLM(preset("debug"))
        >>> kv_dtype_for(m, None), kv_dtype_for(m, "bfloat16")
        (torch.float32, torch.bfloat16)
    """
    own = model.anchor.dtype
    if choice is None or choice == "auto":
        quantised = getattr(model, "quantized", "none") != "none"
        # not where bf16 products are emulated (a CPU without AVX512-BF16 or AMX): there a
        # bf16 cache made Granite-4.0-H-350M's decode at 16K 3.6x slower than llama.cpp's
        # (one attention layer at 16K: 148 against 25 ms a token in fp32)
        fast = fast_low_precision_matmul(torch.bfloat16, model.anchor.device)
        return torch.bfloat16 if quantised and own == torch.float32 and fast else own
    if isinstance(choice, torch.dtype):
        return choice
    if choice not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype: expected one of {KV_DTYPES}, got {choice!r}")
    return getattr(torch, choice)


def kv_block_bytes(model: HylaLM, block_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one paged KV block across all the model's growing (attention) entries, in
    ``dtype`` (default: the model's)."""
    dtype = dtype or model.anchor.dtype
    return block_size * sum(spec.per_token_bytes(dtype) for spec in model.state_specs)


def kv_blocks_for(model: HylaLM, c: EngineConfig) -> int:
    """KV blocks for ``max_num_seqs`` full-length sequences, or as many as
    ``c.kv_cache_memory`` bytes hold; ValueError when those bytes hold fewer than one
    full-length sequence needs (saying the minimum)."""
    per_seq = -(-c.max_model_len // c.block_size)
    most = c.max_num_seqs * per_seq
    if c.kv_cache_memory is None:
        return most
    block = kv_block_bytes(model, c.block_size, kv_dtype_for(model, c.kv_cache_dtype))
    blocks = c.kv_cache_memory // block
    if blocks < per_seq:
        raise ValueError(f"--kv-cache-memory {c.kv_cache_memory} bytes holds {blocks} KV blocks "
                         f"of {block} bytes; one {c.max_model_len}-token sequence needs "
                         f"{per_seq} blocks: at least {per_seq * block} bytes")
    return min(blocks, most)


@dataclass
class StepOutput:
    """What one step produced for one request (a streaming delta)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None        # this request failed (and was aborted); the others go on
    state: object | None = None     # a prefill-only request's SequenceState after its prompt
    # with SamplingParams.prompt_logprobs, on the request's first output: one entry per
    # prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Engine:
    """Continuous-batching inference over one HylaLM.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> eng = Engine(HylaLM(preset("debug")).eval(), ByteTokenizer())
        >>> seqs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=0))
        >>> [len(s.output_ids) for s in seqs], eng.scheduler.pool.num_used
        ([3, 3], 0)
    """

    def __init__(self, model: HylaLM, tokenizer=None, config: EngineConfig | None = None, *,
                 draft_model: HylaLM | None = None):
        """``tokenizer`` None: a token-only engine (no text, no stop strings).
        ``draft_model``: the model of ``speculative="draft:SOURCE"`` (None: SOURCE loaded
        here, unquantised)."""
        if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"model's vocabulary ({model.cfg.vocab_size})")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = c = config or EngineConfig()
        check_speculative(c.speculative)
        if c.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got "
                             f"{c.num_speculative_tokens}")
        # From the mixers' state specs: growing entries (attention keys/values) live in
        # paged KV blocks, fixed ones (GLA matrices) in slots that prefix-cache snapshots copy.
        has_attn = any(spec.per_token for spec in model.state_specs)
        has_gla = any(spec.fixed for spec in model.state_specs)
        blocks = c.num_kv_blocks
        if blocks is None:
            blocks = kv_blocks_for(model, c) if has_attn else 0
        snaps = c.num_state_snapshots
        one = sum(spec.fixed_bytes(model.anchor.dtype) for spec in model.state_specs)
        if c.prefix_cache_memory is not None and has_gla and c.enable_prefix_caching:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if c.prefix_cache_memory > ram // 2:    # allocated up front: refuse, not die
                raise ValueError(f"--prefix-cache-memory {c.prefix_cache_memory} bytes is more "
                                 f"than half this machine's memory ({ram} bytes)")
            snaps = max(1, c.prefix_cache_memory // one)
        if snaps is None and has_gla and c.enable_prefix_caching:
            # a few snapshots a slot (each conversation keeps its prompt's and its answer's):
            # with one a slot, eight chats taking turns on four slots evicted each other's
            # and never hit; at most DEFAULT_SNAPSHOT_BYTES, at least one a slot
            snaps = max(c.max_num_seqs, min(8 * c.max_num_seqs, DEFAULT_SNAPSHOT_BYTES // one))
        snaps = snaps or 0
        if c.snapshot_interval < c.block_size or c.snapshot_interval % c.block_size:
            raise ValueError(f"--snapshot-interval must be a multiple of the block size "
                             f"({c.block_size}), got {c.snapshot_interval}")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len, block_size=c.block_size,
            num_kv_blocks=blocks if has_attn else 0, decode_widths=c.decode_widths,
            enable_prefix_caching=c.enable_prefix_caching,
            num_state_snapshots=snaps if has_gla else 0, snapshot_interval=c.snapshot_interval))
        kv_dtype = kv_dtype_for(model, c.kv_cache_dtype)
        self.runner = Runner(model, max_num_seqs=c.max_num_seqs, num_kv_blocks=blocks,
                             block_size=c.block_size,
                             num_snapshots=snaps if has_gla else 0, compile=c.compile,
                             cuda_graphs=c.cuda_graphs, kv_dtype=kv_dtype,
                             eager_until_built=c.compile and c.eager_until_compiled)
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.snapshot_intact = self.runner.snapshot_intact
        # what the prefix cache's state snapshots hold (``hyla serve`` logs it)
        self.snapshot_bytes = one * snaps if has_gla else 0
        # what the paged KV blocks hold (``hyla serve`` logs it)
        self.kv_cache_bytes = (blocks * kv_block_bytes(model, c.block_size, kv_dtype)
                               if has_attn else 0)
        self.eos_token_id = getattr(tokenizer, "eos_id", None)
        self.end_ids = tuple(getattr(tokenizer, "stop_ids", ()))
        # structured output: a grammar's matcher a request, masks computed as the model runs
        self.constraints = Constraints(tokenizer, model.cfg.vocab_size, tuple(dict.fromkeys(
            ([] if self.eos_token_id is None else [self.eos_token_id]) + list(self.end_ids))))
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._text: dict[str, IncrementalText] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._prefill_only: dict[str, SamplingParams] = {}    # rid -> the caller's params
        self._prompt_lps: dict[str, list[TokenLogprob | None]] = {}   # scored so far
        # draft:SOURCE's model (a restarted engine takes it again) and its states
        self.draft_model, self.draft_slots, new_drafter = model_drafters(
            c, model, tokenizer, draft_model)
        if c.speculative == "mtp":  # MTP drafts read the target's hidden states
            self.runner.hidden_log = HiddenLog()
        self.speculator = None if c.speculative is None else Speculator(
            c.num_speculative_tokens, new_drafter)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                      "decode_steps": 0, "decode_time_s": 0.0, "prefill_time_s": 0.0,
                      "step_time_s": 0.0, "draft_tokens": 0, "accepted_tokens": 0}

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None,
                    *, prefill_only: bool = False, group: str | None = None) -> Sequence:
        """Queue a request; raises ValueError (naming what is wrong) if it cannot run, and
        then queues nothing.

        ``prefill_only``: prefill the prompt and sample the first token (with ``params``
        and its seed, as any request), then hand the state over and stop: the step's
        :class:`StepOutput` for it is ``finished`` and holds the first token and ``state``,
        the :class:`~hyla.model.state.SequenceState` after the prompt
        (:meth:`Runner.extract`), which another engine's :meth:`add_prefilled` continues.
        Its slot and blocks are free once the step returns. Only the prompt must fit.
        ``group``: the request it belongs to, shared by the prompts of one batch request,
        which the scheduler serves as one request beside others (fair turns and slots).

        Example:
            >>> from hyla.model import HylaLM, preset
            >>> eng = Engine(HylaLM(preset("debug")).eval())
            >>> _ = eng.add_request([1, 2, 3], SamplingParams(temperature=0), prefill_only=True)
            >>> (o,) = eng.step()
            >>> o.finished, len(o.token_ids), o.state.num_tokens, eng.has_unfinished()
            (True, 1, 3, False)
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request_id {rid!r} is already running")
        self.check_request(prompt_ids, params, prefill_only=prefill_only)
        seq = Sequence(rid, list(prompt_ids), params,
                       arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                       eos_token_id=self.eos_token_id, end_ids=self.end_ids, group=group)
        if prefill_only:
            # only the first token is produced here; the scheduler reserves for that alone
            seq.params = dataclasses.replace(params, max_tokens=1)
            self._prefill_only[rid] = params
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        if params.prompt_logprobs is not None:
            self._prompt_lps[rid] = [None]
        if self.tokenizer is not None and not prefill_only:
            self._text[rid] = IncrementalText(self.tokenizer, params.stop)
        if params.grammar is not None:
            self.constraints.add(rid, params.grammar)
        if params.seed is not None and not params.greedy:
            g = torch.Generator(device=self.runner.device)
            self._generators[rid] = g.manual_seed(params.seed)
        return seq

    def add_prefilled(self, prompt_ids: list[int], first_token: int, state,
                      params: SamplingParams, request_id: str | None = None,
                      arrival_time: float | None = None) -> Sequence:
        """Queue a request whose prompt was prefilled elsewhere (disaggregated prefill).

        ``state`` is the SequenceState after the prompt and ``first_token`` the token sampled
        from its last logits; the sequence goes straight to decoding once it gets a slot.
        The first token is not emitted again: the caller already has it.
        """
        if state.num_tokens != len(prompt_ids):
            raise ValueError(f"state holds {state.num_tokens} tokens, the prompt "
                             f"{len(prompt_ids)}")
        self.runner.model.check_state(state, "state")
        seq = self.add_request(prompt_ids, params, request_id, arrival_time)
        seq.output_ids.append(first_token)
        seq.num_computed_tokens = len(prompt_ids)
        seq.external_state = state
        seq.first_token_time = seq.arrival_time
        wrong = self.constraints.consume(seq.request_id, first_token)
        if wrong is not None:
            self.abort(seq.request_id)
            raise ValueError(f"grammar: the prefilled first token does not fit: {wrong}")
        reason = seq.stop_reason_for(first_token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq.request_id)
        return seq

    def check_request(self, prompt_ids: list[int], params: SamplingParams, *,
                      prefill_only: bool = False) -> None:
        """Raise ValueError naming what is wrong if the request could never run
        (``prefill_only``: as :meth:`add_request`'s, which only produces a first token)."""
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self.scheduler.check(len(prompt_ids), 1 if prefill_only else params.max_tokens)
        if params.stop and self.tokenizer is None and not prefill_only:
            raise ValueError("stop strings need a tokenizer (this engine is token-only)")
        if params.grammar is not None:
            self.constraints.compiler.compile(params.grammar)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its slot and blocks; False if it is unknown/finished."""
        seq = self.scheduler.abort(request_id)
        self._forget(request_id)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warmup(self) -> int:
        """Compile (and with ``cuda_graphs`` capture) every decode shape the scheduler can
        produce (a no-op when eager), so serving never compiles; returns the number of
        graphs compiled (``runner.num_captures`` counts the captured ones)."""
        if not self.runner.fixed_shapes:
            return 0
        c = self.config
        widths = self.scheduler.config.decode_widths
        verify_widths = ()
        if self.speculator is not None:     # the widths k drafts and their token fill
            verify_widths = tuple(w for w in widths if 1 < w <= c.num_speculative_tokens + 1)
        built = self.runner.warmup(widths, -(-c.max_model_len // c.block_size),
                                   verify_widths=verify_widths)
        if self.draft_slots is not None:
            built += self.draft_slots.warmup()
        return built

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, compute and sample once; the new tokens of every request touched."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self.stats["steps"] += 1
        speculated = self.speculator.step(self, out) if self.speculator is not None else None
        if speculated is not None:
            self.stats["step_time_s"] += time.perf_counter() - t0
            return speculated
        self.constraints.start([s.request_id for s in out.decodes]
                               + [c.seq.request_id for c in out.prefills if c.samples])
        logits, seqs = self._execute(out)
        if any(s.params.penalised for s in seqs):
            apply_penalties(logits, [s.params for s in seqs], [s.prompt_ids for s in seqs],
                            [s.output_ids for s in seqs])
        self.constraints.apply(logits, [s.request_id for s in seqs])
        tokens, logps, failed = self._sample(logits, seqs)
        for seq, token in zip(seqs, tokens, strict=True):
            wrong = self.constraints.consume(seq.request_id, token)
            if wrong is not None and seq.request_id not in failed:
                failed[seq.request_id] = ValueError(wrong)
        sampled = {s.request_id: t for s, t in zip(seqs, tokens, strict=True)}
        states = self._take_states(seqs, failed)
        finished = set(id(s) for s in self.scheduler.update(out, sampled))
        self.runner.copy_snapshots(out.snapshot_saves, save=True)
        now = time.perf_counter()
        results = []
        for seq, token, lp in zip(seqs, tokens, logps, strict=True):
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.request_id in failed:
                results.append(self._fail(seq, None, failed[seq.request_id]))
                continue
            try:
                if seq.request_id in states:
                    results.append(self._handover(seq, token, lp, states[seq.request_id]))
                else:
                    results.append(self._emit(seq, token, lp, id(seq) in finished))
            except Exception as e:  # noqa: BLE001 - one request's output failed, not the batch
                results.append(self._fail(seq, token, e))
        self.stats["generation_tokens"] += len(seqs)
        self.stats["step_time_s"] += time.perf_counter() - t0
        return results

    def verdict(self, logits: torch.Tensor, drafts: list[int], seq: Sequence
                ) -> tuple[int, int]:
        """Speculative decoding: how many of ``drafts`` ``seq`` keeps and the token after
        them, from the verify pass's ``logits`` (:func:`hyla.model.sampler.accept_drafts`,
        with the request's seeded generator)."""
        return accept_drafts(logits, drafts, seq.params, self._generators.get(seq.request_id))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]
                ) -> tuple[list[int], list[TokenLogprob | None], dict[str, Exception]]:
        """Tokens for ``seqs`` (one row of ``logits`` each). A row the sampler fails on
        (its error in the returned dict, by request id) gets a placeholder token, the
        argmax, so the scheduler can advance the batch; the caller fails that request
        alone. The batch is sampled at once, and row by row only after a failure."""
        if not seqs:
            return [], [], {}
        params = [s.params for s in seqs]
        gens = [self._generators.get(s.request_id) for s in seqs]
        try:
            tokens, logps = self.config.sampler(logits, params, gens)
            return list(tokens), list(logps), {}
        except Exception:  # noqa: BLE001 - find the rows at fault below
            pass
        tokens, logps, failed = [], [], {}
        for b, seq in enumerate(seqs):
            try:
                (t,), (lp,) = self.config.sampler(logits[b:b + 1], [params[b]], [gens[b]])
            except Exception as e:  # noqa: BLE001 - this request alone fails
                t, lp = int(logits[b].argmax()), None
                failed[seq.request_id] = e
            tokens.append(int(t))
            logps.append(lp)
        return tokens, logps, failed

    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        r = self.runner
        for seq in out.loads:
            r.load(seq.slot, seq.external_state, seq.block_table)
            seq.external_state = None
        r.copy_snapshots(out.restores, save=False)
        parts, seqs = [], []
        if out.decodes:
            t0 = time.perf_counter()
            for s in out.decodes:
                if s.num_computed_tokens == 0:  # a one-token prompt starts as a decode: its
                    r.reset_slot(s.slot)        # slot still holds the last sequence's state
            d = sorted(out.decodes, key=lambda s: s.slot)   # consecutive slots: in place
            parts.append(r.decode([s.slot for s in d],
                                  [s.token_at(s.num_computed_tokens) for s in d],
                                  [s.num_computed_tokens for s in d],
                                  [s.block_table for s in d], out.decode_width))
            seqs += d
            self.stats["decode_steps"] += 1
            self.stats["decode_time_s"] += time.perf_counter() - t0
        if out.prefills:
            t0 = time.perf_counter()
            for c in out.prefills:
                if c.start == 0:
                    r.reset_slot(c.seq.slot)
            chunks = [(c.seq.slot, c.seq.all_token_ids[c.start:c.end], c.start,
                       c.seq.block_table) for c in out.prefills]
            score = [self._score_request(c) for c in out.prefills]
            if any(x is not None for x in score):
                logits, scored = r.prefill_scored(chunks, score)
                self._keep_scores(out.prefills, score, scored)
            else:
                logits = r.prefill(chunks)
            keep = [i for i, c in enumerate(out.prefills) if c.samples]
            parts.append(logits[keep])
            seqs += [out.prefills[i].seq for i in keep]
            self.stats["prompt_tokens"] += sum(c.num_tokens for c in out.prefills)
            self.stats["prefill_time_s"] += time.perf_counter() - t0
        return torch.cat(parts) if parts else torch.empty(0), seqs

    def _score_request(self, c) -> tuple[list[int], int] | None:
        """(the prompt tokens chunk ``c``'s rows predict, top-k) when its request asks
        for prompt logprobs and they are not out yet; None otherwise."""
        seq = c.seq
        if seq.request_id not in self._prompt_lps:
            return None
        if c.start == 0:                    # first chunk, or recomputed after preemption
            self._prompt_lps[seq.request_id] = [None]
        n = seq.num_prompt_tokens
        targets = seq.prompt_ids[c.start + 1:min(c.end, n - 1) + 1]
        return (targets, seq.params.prompt_logprobs) if targets else None

    def _keep_scores(self, chunks, score, scored) -> None:
        for c, sc, rows in zip(chunks, score, scored, strict=True):
            if rows is None:
                continue
            ids, lps = sc[0], rows.logprobs.tolist()
            tops = zip(rows.top_ids.tolist(), rows.top_logprobs.tolist(), strict=True)
            self._prompt_lps[c.seq.request_id] += [
                TokenLogprob(t, lp, list(zip(ti, tv, strict=True)))
                for t, lp, (ti, tv) in zip(ids, lps, tops, strict=True)]

    def _emit(self, seq: Sequence, token: int, lp: TokenLogprob | None,
              finished: bool) -> StepOutput:
        prompt_lps = self._prompt_lps.pop(seq.request_id, None)
        if seq.params.max_tokens == 0:      # the prompt scored alone: the token is dropped
            if not seq.is_finished:
                self.scheduler.finish(seq, "length")
            self._forget(seq.request_id)
            return StepOutput(seq.request_id, [], "", True, "length", [],
                              seq.num_prompt_tokens, 0, prompt_logprobs=prompt_lps)
        text = self._text.get(seq.request_id)
        grammar_end = self.constraints.done(seq.request_id)
        # EOS / stop id, or the token a grammar ended on (byte 0 for the byte tokenizer,
        # which has no EOS): no text
        stop_token = (finished and seq.finish_reason == "stop") or (
            grammar_end and token in self.constraints.stop_ids)
        delta = text.add(seq.output_ids, hide_last=stop_token) if text is not None else ""
        if not finished and ((text is not None and text.stopped) or grammar_end):
            self.scheduler.finish(seq, "stop")      # a stop string, or the grammar's end
            finished = True
        if finished and text is not None:
            delta += text.flush()
        if finished:
            self._forget(seq.request_id)
        return StepOutput(seq.request_id, [token], delta, finished, seq.finish_reason,
                          [lp] if lp is not None else [], seq.num_prompt_tokens,
                          len(seq.output_ids), prompt_logprobs=prompt_lps)

    def _fail(self, seq: Sequence, token: int | None, err: Exception) -> StepOutput:
        """End a request whose output could not be produced (its tokens could not be
        sampled, its tokenizer could not decode a sampled id, its state could not be
        taken): free what it holds and report the error for it alone."""
        self.scheduler.abort(seq.request_id)
        self._forget(seq.request_id)
        return StepOutput(seq.request_id, [] if token is None else [token], "", True,
                          "error", [],
                          seq.num_prompt_tokens, len(seq.output_ids),
                          error=f"{type(err).__name__}: {err}")

    # -- prefill-only requests (disaggregated prefill) ----------------------------------
    def _take_states(self, seqs: list[Sequence], failed: dict[str, Exception]) -> dict:
        """The states of this step's prefill-only requests (all sampled their first token:
        their prompts are done), taken before the scheduler frees their slots and blocks.
        One that cannot be taken goes into ``failed``."""
        if not self._prefill_only:
            return {}
        states = {}
        for s in seqs:
            if s.request_id in self._prefill_only and s.request_id not in failed:
                try:
                    states[s.request_id] = self.runner.extract(s.slot, s.num_prompt_tokens,
                                                               s.block_table)
                except Exception as e:  # noqa: BLE001 - this request alone fails
                    failed[s.request_id] = e
        return states

    def _handover(self, seq: Sequence, token: int, lp: TokenLogprob | None,
                  state) -> StepOutput:
        """End a prefill-only request: its first token and state go out, nothing stays."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "length")
        seq.params = self._prefill_only[seq.request_id]
        self._forget(seq.request_id)
        return StepOutput(seq.request_id, [token], "", True, seq.finish_reason,
                          [lp] if lp is not None else [], seq.num_prompt_tokens, 1,
                          state=state)

    def _forget(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(request_id)
        self._prefill_only.pop(request_id, None)
        self.constraints.forget(request_id)
        self._prompt_lps.pop(request_id, None)
        self._seqs.pop(request_id, None)
        self._text.pop(request_id, None)
        self._generators.pop(request_id, None)

    # -- offline -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Sequence]:
        """Run ``prompts`` to completion together; returns their Sequences in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        return seqs
