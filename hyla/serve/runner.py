"""The engine's torch side: batched prefill and decode over slot-indexed state buffers.

Memory is allocated once, from the mixers' StateSpecs: per layer, each fixed-size entry
(a GLA matrix) as ``[max_num_seqs + 1, *shape]`` (the last row absorbs padded decode rows)
plus ``[num_snapshots, *shape]`` prefix-cache snapshots, and each growing entry (attention
keys, values) paged as ``[num_kv_blocks + 1, block_size, *row]`` (the last block absorbs
padding). Sequences are addressed by their slot and block table, which the (pure-Python)
scheduler hands out; a :class:`~hyla.model.context.Context` hands the buffers to the model.

Decode runs at a fixed set of batch widths, so ``torch.compile`` sees a closed set of
shapes; ``num_compilations`` counts the graphs it built. The block tables' length is
symbolic in those graphs (attention reads the paged cache in place,
:mod:`hyla.ops.paged_attention`), so there is one graph a width. On CUDA,
``cuda_graphs=True`` also captures each shape (tables padded to powers of two) as a CUDA graph
(:mod:`hyla.serve.cuda_graphs`; ``num_captures`` counts them) and decode replays it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hyla.model import Context, HylaLM, SequenceState
from hyla.ops.paged_attention import FUSED_MAX_ROWS, SPAN_MAX_BATCH, kv_spans
from hyla.serve.compiled_decode import compile_decode
from hyla.serve.lazy_zeros import lazy_zeros

log = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class ScoredRows:
    """Prompt-token scores of one chunk (:meth:`Runner.prefill_scored`): ``logprobs``
    [rows] of the tokens that follow each row, ``top_ids``/``top_logprobs`` [rows, k]."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


class Runner:
    """Holds a model and its per-slot buffers; computes logits for scheduled tokens.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> r = Runner(HylaLM(preset("debug")).eval(), max_num_seqs=2, num_kv_blocks=4)
        >>> r.prefill([(0, [1, 2, 3], 0, [0])]).shape
        torch.Size([1, 256])
        >>> r.decode([0], [4], [3], [[0]], width=2).shape
        torch.Size([1, 256])
    """

    def __init__(self, model: HylaLM, *, max_num_seqs: int, num_kv_blocks: int,
                 block_size: int = 16, num_snapshots: int = 0, compile: bool = False,
                 cuda_graphs: bool = False, capture=None, kv_dtype: torch.dtype | None = None,
                 kv_in_place: bool = True, eager_until_built: bool = False):
        """``compile``: decode through ``torch.compile`` (fixed shapes). ``cuda_graphs``:
        replay each decode shape as a captured CUDA graph (needs a CUDA model unless a
        stand-in ``capture`` function is given, as the CPU tests do). ``kv_dtype``: the
        paged KV blocks' dtype (default: the model's). ``kv_in_place``: eager decode reads
        a sequence's consecutive KV blocks as views (False: always gather them, as before).
        ``eager_until_built`` (with ``compile``): a width runs eagerly until :meth:`warmup`
        has built its graph, so a server serves while its graphs compile in the background
        (else the first call of each shape compiles it)."""
        self.model = model
        p = model.anchor
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype or self.dtype
        self.kv_in_place = kv_in_place
        self.pad_slot = max_num_seqs
        self.pad_block = num_kv_blocks
        self.specs = model.state_specs
        self.has_growing = any(spec.per_token for spec in self.specs)
        self.has_fixed = any(spec.fixed for spec in self.specs)
        if self.has_growing and num_kv_blocks < 1:
            raise ValueError("the model has layers whose state grows per token (attention): "
                             "num_kv_blocks must be >= 1")
        self.buffers: list[dict[str, torch.Tensor]] = []      # what the Context hands mixers
        self.snapshots: list[dict[str, torch.Tensor]] = []    # fixed entries only
        for spec in self.specs:
            layer, snaps = {}, {}
            for e in spec.fixed:
                dt = e.resolve(self.dtype)
                layer[e.name] = torch.zeros(max_num_seqs + 1, *e.shape, device=self.device,
                                            dtype=dt)
                snaps[e.name] = torch.zeros(num_snapshots, *e.shape, device=self.device,
                                            dtype=dt)
            for e in spec.per_token:
                layer[e.name] = lazy_zeros((num_kv_blocks + 1, block_size, *e.shape),
                                           e.resolve(self.kv_dtype), self.device)
            self.buffers.append(layer)
            self.snapshots.append(snaps)
        # each snapshot's checksum when it was saved: one that no longer matches (memory
        # corrupted since) is dropped by the prefix cache, never restored
        self.snapshot_sums: list[int | None] = [None] * num_snapshots
        self._sum_weights: dict = {}
        self.compiled = compile
        self._compiled_fn = None
        self.skip_module_guards = True      # (False: torch's guard filter failed on the model)
        self._decode_fn = self._compiled_decode if compile else self._decode_impl
        self.eager_until_built = eager_until_built
        self.built_widths: set[int] = set()     # widths warmup has compiled (or captured)
        self.built_verify_widths: set[int] = set()  # and their verify graphs (quantised)
        self.width_seconds: dict[int, float] = {}   # a compiled step's time by width (EMA)
        # quantised layers verify drafts in their own graphs, one row's products in each row
        self.quantised = getattr(model, "quantized", None) not in (None, "none")
        self.compile_error: str | None = None   # why building the graphs failed, if it did
        # a HiddenLog (set before the first call): every row's final hidden state is kept
        # by slot and position, for multi-token-prediction drafts
        self.hidden_log = None
        self.num_compilations = 0      # graphs torch.compile built for decode
        self.compile_time_s = 0.0      # wall time of the decode calls that compiled
        self.graphs = None
        if cuda_graphs:
            if self.device.type != "cuda" and capture is None:
                raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, "
                                 f"got {self.device}")
            from hyla.serve.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self._decode_fn, capture=capture)

    def _compiled_decode(self, *args, one_row: bool = False):
        """:meth:`_decode_impl` through ``torch.compile`` (:mod:`~hyla.serve.compiled_decode`),
        set up on first use."""
        if self._compiled_fn is None:
            self._compiled_fn = compile_decode(self._decode_impl, self.model,
                                               skip_module_guards=self.skip_module_guards)
        return self._compiled_fn(*args, one_row=one_row)

    @property
    def fixed_shapes(self) -> bool:
        """Decode pads to fixed widths and block-table lengths (compiled or graphed)."""
        return self.compiled or self.graphs is not None

    def runs_graph(self, width: int) -> bool:
        """Whether a decode of this width runs its compiled (or captured) graph."""
        return self.fixed_shapes and (not self.eager_until_built or width in self.built_widths)

    def decode_mode(self, widths) -> str:
        """How decode steps of ``widths`` (the scheduler's) run, for ``/health``: ``eager``,
        ``compiling`` (eager until a background warm-up builds each width's graph),
        ``compiled``, ``cuda_graphs``, or ``eager-fallback`` (building failed:
        :attr:`compile_error` says why; the widths not built stay eager)."""
        if not self.fixed_shapes:
            return "eager"
        if self.compile_error is not None:
            return "eager-fallback"
        if self.eager_until_built and not set(widths) <= self.built_widths:
            return "compiling"
        return "cuda_graphs" if self.graphs is not None else "compiled"

    @property
    def num_captures(self) -> int:
        """CUDA graphs captured for decode (0 without ``cuda_graphs``)."""
        return self.graphs.num_captures if self.graphs is not None else 0

    # -- state movement ----------------------------------------------------------------
    def _fixed(self):
        """(buffer, snapshot buffer) of every fixed-size state entry."""
        for layer, snaps in zip(self.buffers, self.snapshots, strict=True):
            for name, snap in snaps.items():
                yield layer[name], snap

    def reset_slot(self, slot: int) -> None:
        for buf, _ in self._fixed():
            buf[slot].zero_()
        if self.hidden_log is not None:
            self.hidden_log.clear(slot)

    def copy_snapshots(self, pairs: list[tuple[int, int]], *, save: bool) -> None:
        """``save``: (state slot, snapshot slot) copies; else (snapshot slot, state slot)."""
        for a, b in pairs:
            for buf, snap in self._fixed():
                if save:
                    snap[b].copy_(buf[a])
                else:
                    buf[b].copy_(snap[a])
            if save:
                self.snapshot_sums[b] = self._snapshot_sum(b)
            elif self.hidden_log is not None:
                self.hidden_log.clear(b)

    def snapshot_intact(self, slot: int) -> bool:
        """Whether snapshot ``slot`` still holds what was saved (its checksum matches)."""
        return self.snapshot_sums[slot] is not None and \
            self._snapshot_sum(slot) == self.snapshot_sums[slot]

    def _snapshot_sum(self, slot: int) -> int:
        """The sum of a snapshot's bytes as 32-bit words, weighted by their place modulo a
        prime (any one flipped bit, and any swap of words, changes it): one pass at memory
        speed, where a CRC would cost a few ms a snapshot on a CPU."""
        total = 0
        for _, snap in self._fixed():
            words = snap[slot].reshape(-1).view(torch.uint8)
            words = words[:words.numel() // 4 * 4].view(torch.int32)
            key = (words.numel(), words.device)
            if key not in self._sum_weights:
                self._sum_weights[key] = torch.arange(1, key[0] + 1, device=key[1]) % 65_521
            total += int(words.long().mul_(self._sum_weights[key]).sum())
        return total

    def save_scratch(self, slot: int) -> list[torch.Tensor]:
        """Copies of a slot's fixed-size states (speculative decoding keeps them while it
        verifies drafts, to go back if some are rejected)."""
        return [buf[slot].clone() for buf, _ in self._fixed()]

    def restore_scratch(self, slot: int, saved: list[torch.Tensor]) -> None:
        for (buf, _), t in zip(self._fixed(), saved, strict=True):
            buf[slot].copy_(t)

    @torch.inference_mode()
    def verify(self, slot: int, tokens: list[int], start: int, block_table: list[int],
               widths: tuple[int, ...] = ()) -> torch.Tensor:
        """Logits [len(tokens), vocab] (fp32) at every token of a chunk that continues a slot
        after ``start`` tokens (speculative decoding's drafts, behind the last sampled
        token): a prefill chunk whose every row is kept.

        ``widths`` (the decode widths): where :attr:`verifies_as_batch` and the smallest
        width that holds the tokens runs a compiled graph, the tokens run as that width's
        decode batch of the one sequence at consecutive positions instead (SmolLM2 in
        float, 4 tokens: 75.6 ms at width 4 against 90.8 ms eager; Xeon, one thread)."""
        n = len(tokens)
        width = next((w for w in widths if w >= n), None)
        as_batch = None             # (width, through its graph) of a decode batch
        if width is not None and self.verifies_as_batch and self.verify_graph_built(width):
            as_batch = (width, True)
        elif not self.fixed_shapes and (not self.has_fixed or self.quantised):
            # eager: the rows as a decode batch, so each takes a plain step's attention and
            # products (a prefill chunk's rounds otherwise; through bf16 activations that
            # parted a greedy SmolLM2 int4 answer from plain decoding's at token 45 in hyla
            # generate), fixed-size states a row at a time (Context.chain: the chunk form
            # parted an int4 Qwen3.5-like answer at a near-tie). Float models with fixed
            # states keep the chunk: their projections would run row by row
            as_batch = (n, False)
        if as_batch is not None:
            return self._decode([slot] * n, tokens, list(range(start, start + n)),
                                [block_table] * n, *as_batch, one_row=self.quantised)
        from hyla.model.quantize import one_row_products

        ids = torch.tensor(tokens, device=self.device)
        ctx = Context.prefill([start], [n], [slot], [block_table], self.buffers,
                              block_size=self.block_size, pad_block=self.pad_block,
                              device=self.device, last_logits=False)
        # quantised: each row in the products one row takes (a plain step's), not a
        # chunk's (the output layer's fbgemm int8 products, say): else a greedy choice at
        # a near-tie depends on the drafts (found: SmolLM2 int4-a8 in hyla generate)
        with one_row_products(self.quantised):
            return self._forward(ids, ctx, [(slot, tokens, start, block_table)])

    @torch.inference_mode()
    def verify_batch(self, rows: list[tuple[int, list[int], int, list[int]]],
                     widths: tuple[int, ...]) -> list[torch.Tensor]:
        """:meth:`verify` for several sequences at once, ``(slot, tokens, start,
        block_table)`` each, as one decode batch of the smallest of ``widths`` that holds
        every row (where :attr:`verifies_as_batch` and that width :meth:`runs_graph`).
        Logits [len(tokens), vocab] (fp32) a sequence. A quantised model's rows take a
        decode batch's products, as those sequences' plain steps together would (each
        row's own: what else is in the batch changes nothing)."""
        slots, tokens, positions, tables = [], [], [], []
        for slot, toks, start, table in rows:
            slots += [slot] * len(toks)
            tokens += toks
            positions += range(start, start + len(toks))
            tables += [table] * len(toks)
        width = next(w for w in widths if w >= len(tokens))
        logits = self._decode(slots, tokens, positions, tables, width, True)
        return list(logits.split([len(t) for _, t, _, _ in rows]))

    @property
    def verifies_as_batch(self) -> bool:
        """Whether :meth:`verify` may run drafts as a compiled decode batch of one sequence.
        Every mixer that grows per token writes a step's rows before any row reads, so each
        row sees the ones before it; a fixed-size state (GLA, a conv window, a ring: one slot,
        many rows) could not. Quantised layers take other products for a batch than for one
        row (fbgemm's, 8-bit activations with "-a8"), so a greedy choice at a near-tie would
        depend on the drafts (found: a repeated request's answer changed): their verify
        batches run in one row's products (:class:`hyla.model.quantize.one_row_products`),
        graphs of their own."""
        return self.fixed_shapes and not self.has_fixed

    def verify_graph_built(self, width: int) -> bool:
        """Whether a verify batch of ``width`` runs a graph now (a quantised model's verify
        graphs are built by :meth:`warmup`'s ``verify_widths``, or on first use)."""
        if not self.quantised:
            return self.runs_graph(width)
        return self.compiled and (not self.eager_until_built
                                  or width in self.built_verify_widths)

    def _warm(self, *args) -> None:
        """A warm-up step (the padding slot's state only): where torch's module-guard filter
        fails on the model, the graphs are built again with every guard."""
        try:
            self._decode(*args)
        except KeyError as e:
            if not (self.compiled and self.skip_module_guards):
                raise
            log.warning("torch.compile with module guards skipped failed on this model "
                        "(KeyError %s): building the decode graphs with every guard", e)
            self.skip_module_guards, self._compiled_fn = False, None
            torch._dynamo.reset()       # the failing entries are cached by code object
            self._decode(*args)

    def extract(self, slot: int, num_tokens: int, block_table: list[int]) -> SequenceState:
        """A standalone SequenceState (copies) of what a slot and its blocks hold."""
        rows = self._rows(block_table, num_tokens)
        tensors = [tuple(layer[e.name][slot].clone() for e in spec.fixed)
                   + tuple(layer[e.name][rows].to(e.resolve(self.dtype)) for e in spec.per_token)
                   for spec, layer in zip(self.specs, self.buffers, strict=True)]
        return SequenceState([s.kind for s in self.specs], tensors, num_tokens)

    def load(self, slot: int, state: SequenceState, block_table: list[int]) -> None:
        """Write a SequenceState (e.g. one shipped from a prefill worker) into a slot; one
        from ``state.start`` on goes after the rows the table's first blocks hold."""
        self.model.check_state(state, "state")
        n = state.num_tokens
        if self.has_growing and len(block_table) * self.block_size < n:
            raise ValueError(f"block_table holds {len(block_table)} blocks: too few for "
                             f"{n} tokens")
        # a state from ``start`` on: the table's first blocks hold the cached prefix's rows
        rows = self._rows(block_table, n, state.start)
        if self.hidden_log is not None:
            self.hidden_log.clear(slot)
        for spec, layer, ts in zip(self.specs, self.buffers, state.tensors, strict=True):
            for e, t in zip(spec.entries, ts, strict=True):
                if e in spec.fixed:
                    layer[e.name][slot].copy_(t)
                else:
                    layer[e.name][rows] = t.to(self.device, layer[e.name].dtype)

    def _rows(self, block_table: list[int], n: int, start: int = 0):
        """Index of rows ``start`` to n of a block table into a paged buffer."""
        pos = torch.arange(start, n, device=self.device)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return table[pos // self.block_size], pos % self.block_size

    # -- compute -----------------------------------------------------------------------
    @torch.inference_mode()   # cheaper than no_grad a call: no version counters
    def prefill(self, chunks: list[tuple[int, list[int], int, list[int]]]) -> torch.Tensor:
        """Compute prompt chunks of several sequences packed together.

        Args:
            chunks: (slot, token ids, start position, block table) per sequence; the slot
                holds the state after ``start`` tokens (zeroed by the caller for start 0).
        Returns:
            logits [len(chunks), vocab] (fp32) at each chunk's last token.
        """
        ids = torch.tensor([t for c in chunks for t in c[1]], device=self.device)
        ctx = Context.prefill([c[2] for c in chunks], [len(c[1]) for c in chunks],
                              [c[0] for c in chunks], [c[3] for c in chunks], self.buffers,
                              block_size=self.block_size, pad_block=self.pad_block,
                              device=self.device)
        return self._forward(ids, ctx, chunks)

    def _forward(self, ids: torch.Tensor, ctx: Context, chunks) -> torch.Tensor:
        """Logits (fp32) of a packed prefill at ``ctx.logits_at`` (None: every row). With a
        :attr:`hidden_log`, every row's hidden state is logged under its chunk's slot and
        positions."""
        if self.hidden_log is None:
            return self.model(ids[None], ctx)[0].float()
        at, ctx.logits_at = ctx.logits_at, None
        hidden = self.model(ids[None], ctx, hidden=True)[0]
        self._log(chunks, hidden)
        return self.model.lm_head(hidden if at is None else hidden[at]).float()

    def _log(self, chunks, hidden: torch.Tensor) -> None:
        a = 0
        for slot, toks, start, _ in chunks:
            if slot != self.pad_slot:
                self.hidden_log.put(slot, start, hidden[a:a + len(toks)])
            a += len(toks)

    @torch.inference_mode()   # cheaper than no_grad a call: no version counters
    def prefill_scored(self, chunks: list[tuple[int, list[int], int, list[int]]],
                       score: list[tuple[list[int], int] | None], *, rows_at_once: int = 256
                       ) -> tuple[torch.Tensor, list[ScoredRows | None]]:
        """:meth:`prefill`, also scoring prompt tokens: ``score[j] = (targets, k)`` asks for
        the log-probability of ``targets[i]`` at row i of chunk j (the token that follows
        it) and the k most likely tokens there (k = 0: none). The head runs on
        ``rows_at_once`` rows at a time, so no ``[tokens, vocab]`` matrix is ever held.

        Returns (logits [len(chunks), vocab] at each chunk's last token, one
        :class:`ScoredRows` or None per chunk).

        Example:
            >>> from hyla.model import HylaLM, preset
            >>> r = Runner(HylaLM(preset("debug")).eval(), max_num_seqs=1, num_kv_blocks=4)
            >>> last, (s,) = r.prefill_scored([(0, [1, 2, 3], 0, [0])], [([2, 3], 1)])
            >>> last.shape, s.logprobs.shape, s.top_ids.shape
            (torch.Size([1, 256]), torch.Size([2]), torch.Size([2, 1]))
        """
        ids = torch.tensor([t for c in chunks for t in c[1]], device=self.device)
        ctx = Context.prefill([c[2] for c in chunks], [len(c[1]) for c in chunks],
                              [c[0] for c in chunks], [c[3] for c in chunks], self.buffers,
                              block_size=self.block_size, pad_block=self.pad_block,
                              device=self.device, last_logits=False)
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c[1]))
        last = [s - 1 for s in starts[1:]]
        wanted = set(last)
        for j, sc in enumerate(score):
            if sc is not None:
                if len(sc[0]) > len(chunks[j][1]):
                    raise ValueError(f"chunk {j}: {len(sc[0])} targets for "
                                     f"{len(chunks[j][1])} tokens")
                wanted.update(range(starts[j], starts[j] + len(sc[0])))
        rows = sorted(wanted) if self.hidden_log is None else list(range(starts[-1]))
        index = {r: i for i, r in enumerate(rows)}
        ctx.logits_at = torch.tensor(rows, device=self.device)
        hidden = self.model(ids[None], ctx, hidden=True)[0]          # [rows, d_model]
        if self.hidden_log is not None:
            self._log(chunks, hidden)
        head = self.model.lm_head
        logits = head(hidden[[index[r] for r in last]]).float()
        out: list[ScoredRows | None] = []
        for j, sc in enumerate(score):
            if sc is None:
                out.append(None)
                continue
            targets, k = sc
            at = torch.tensor([index[starts[j] + i] for i in range(len(targets))],
                              device=self.device, dtype=torch.long)
            tgt = torch.tensor(targets, device=self.device, dtype=torch.long)
            lps, top_v, top_i = [], [], []
            for a in range(0, len(targets), rows_at_once):
                lp = torch.log_softmax(head(hidden[at[a:a + rows_at_once]]).float(), dim=-1)
                lps.append(lp.gather(1, tgt[a:a + rows_at_once, None])[:, 0])
                top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                top_v.append(top.values)
                top_i.append(top.indices)
            out.append(ScoredRows(torch.cat(lps).cpu(), torch.cat(top_i).cpu(),
                                  torch.cat(top_v).cpu()))
        return logits, out

    def decode(self, slots: list[int], tokens: list[int], positions: list[int],
               block_tables: list[list[int]], width: int) -> torch.Tensor:
        """One token for each of B sequences.

        ``positions[b]`` is the token's position (tokens already in the state). Compiled,
        the batch is padded to ``width`` rows and the block tables to the longest one (at
        least 2: the tables' length is symbolic, one graph a width); captured as CUDA
        graphs, the tables to a power-of-two length; eager, it runs the B rows as they are
        (padding would only cost time). Returns logits [B, vocab] (fp32).
        """
        return self._decode(slots, tokens, positions, block_tables, width,
                            self.runs_graph(width))

    def _decode(self, slots, tokens, positions, block_tables, width: int, fixed: bool,
                one_row: bool = False):
        out = self._decode_rows(slots, tokens, positions, block_tables, width, fixed, one_row)
        if self.hidden_log is None:
            return out
        d = self.model.cfg.d_model      # (_decode_impl put each row's hidden state last)
        for b, (slot, pos) in enumerate(zip(slots, positions, strict=True)):
            if slot != self.pad_slot:
                self.hidden_log.put(slot, pos, out[b:b + 1, -d:])
        return out[:, :-d].contiguous()

    @torch.inference_mode()   # cheaper than no_grad a call: no version counters
    def _decode_rows(self, slots, tokens, positions, block_tables, width: int, fixed: bool,
                     one_row: bool = False):
        B = len(slots)
        if not 1 <= B <= width:
            raise ValueError(f"decode batch of {B} does not fit width {width}")
        rows = width if fixed else B
        pad = rows - B
        longest = max((len(t) for t in block_tables), default=0)
        if fixed:       # compiled: at least 2 (mark_dynamic below); CUDA graphs: powers of 2
            longest = max(longest, 2) if self.compiled else _pow2(longest)
        nb = longest if self.has_growing else 0
        tables = torch.full((rows, nb), self.pad_block, dtype=torch.long)
        for b, t in enumerate(block_tables if nb else ()):
            tables[b, :len(t)] = torch.tensor(t, dtype=torch.long)
        dev = self.device
        args = (torch.tensor(list(tokens) + [0] * pad, device=dev),
                torch.tensor(list(slots) + [self.pad_slot] * pad, device=dev),
                torch.tensor(list(positions) + [0] * pad, device=dev),
                tables.to(dev))
        if not fixed:
            # Consecutive slots (the usual case: slots are handed out lowest first and the
            # engine sorts the batch) let fixed-size states update in place.
            first = slots[0]
            span = slice(first, first + B) if list(slots) == list(range(first, first + B)) \
                else None
            spans = None
            if self.kv_in_place and nb and B <= SPAN_MAX_BATCH:
                spans = kv_spans(block_tables, positions, self.block_size)
            chain = len(set(slots)) < B     # one sequence's consecutive rows (a verify)
            if one_row:
                from hyla.model.quantize import one_row_products

                with one_row_products():
                    return self._decode_impl(*args, span=span, kv_spans=spans, chain=chain)
            return self._decode_impl(*args, span=span, kv_spans=spans, chain=chain)
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        if self.graphs is not None:
            pad_args = (torch.zeros(rows, dtype=torch.long, device=dev),
                        torch.full((rows,), self.pad_slot, dtype=torch.long, device=dev),
                        torch.zeros(rows, dtype=torch.long, device=dev),
                        torch.full((rows, nb), self.pad_block, dtype=torch.long, device=dev))
            logits = self.graphs(pad_args, args)[:B]
        else:
            if nb:
                # the block tables' length is symbolic in the graph: the attention op reads
                # the rows in place, so every context length runs the same graph (sizes 0
                # and 1 are always specialised, hence tables of at least two blocks)
                torch._dynamo.mark_dynamic(args[3], 1)
            if one_row:
                from hyla.model.quantize import one_row_products

                with one_row_products():
                    logits = self._decode_fn(*args, one_row=True)[:B]
            else:
                logits = self._decode_fn(*args)[:B]
        built = counters["stats"]["unique_graphs"] - before
        seconds = time.perf_counter() - t0
        if built:
            self.num_compilations += built
            self.compile_time_s += seconds
        elif not one_row:       # what a step of this width costs (speculation weighs it)
            last = self.width_seconds.get(width)
            self.width_seconds[width] = seconds if last is None else 0.8 * last + 0.2 * seconds
        return logits

    def warmup(self, widths: tuple[int, ...], max_blocks: int = 0,
               verify_widths: tuple[int, ...] = ()) -> int:
        """Build every decode graph up front: each width (captured as CUDA graphs, x each
        power-of-two block-table length up to ``max_blocks``; compiled graphs serve every
        length, so one call a width builds them, or two where ``max_blocks`` reaches past
        ``FUSED_MAX_ROWS``), then a quantised model's verify graphs of ``verify_widths``
        (speculative decoding's). Writes only to the padding slot and block. Returns the
        number of graphs compiled."""
        before = self.num_compilations
        nbs = [0]
        if self.has_growing and self.graphs is None:
            # compiled attention reads tables of up to FUSED_MAX_ROWS rows one way and longer
            # ones another (attend_compiled): a graph each
            long = FUSED_MAX_ROWS // self.block_size + 1
            nbs = [2, long] if max_blocks >= long else [2]
        elif self.has_growing:
            nbs = [1 << i for i in range(max(1, max_blocks).bit_length())]
            if nbs[-1] < max_blocks:
                nbs.append(nbs[-1] * 2)
        for w in widths:
            for nb in nbs:
                self._warm([self.pad_slot], [0], [0], [[self.pad_block] * nb], w, True)
            # once more, built: what a step of this width costs (speculation weighs it)
            self._decode([self.pad_slot], [0], [0], [[self.pad_block] * nbs[0]], w, True)
            self.built_widths.add(w)
        if self.compiled and self.quantised and self.verifies_as_batch:
            for w in verify_widths:
                for nb in nbs:
                    self._decode([self.pad_slot], [0], [0], [[self.pad_block] * nb], w,
                                 True, one_row=True)
                self.built_verify_widths.add(w)
        return self.num_compilations - before

    def _decode_impl(self, tokens, slots, positions, tables, span: slice | None = None,
                     kv_spans: tuple | None = None, graph_key: int = 0, chain: bool = False):
        if graph_key < 0:       # read, so that torch.compile guards on it (see __init__)
            raise ValueError(f"graph_key must be >= 0, got {graph_key}")
        ctx = Context.decode(slots, positions, tables, self.buffers, block_size=self.block_size,
                             slot_span=span, kv_spans=kv_spans, chain=chain)
        if self.hidden_log is None:
            return self.model(tokens[:, None], ctx)[:, 0].float()
        h = self.model(tokens[:, None], ctx, hidden=True)[:, 0]
        return torch.cat([self.model.lm_head(h).float(), h.float()], dim=-1)

    def layer_rows(self, i: int, table: list[int], n: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s growing entries (e.g. keys and values [n, H_kv, D]) for the first
        n tokens of a block table (gathered copies)."""
        rows = self._rows(table, n)
        return {e.name: self.buffers[i][e.name][rows] for e in self.specs[i].per_token}
