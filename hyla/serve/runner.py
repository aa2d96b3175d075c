"""The engine's torch side: batched prefill and decode over slot-indexed state buffers.

Memory is allocated once: per GLA layer ``[max_num_seqs + 1, H, K, V]`` fp32 states (the
last row absorbs padded decode rows) and ``[num_snapshots, H, K, V]`` prefix-cache
snapshots; per attention layer paged keys and values ``[num_kv_blocks + 1, block_size,
H_kv, D]`` (the last block absorbs padding). Sequences are addressed by their slot and
block table, which the (pure-Python) scheduler hands out.

Decode runs at a fixed set of batch widths (and of block-table lengths, powers of two), so
``torch.compile`` sees a closed set of shapes; ``num_compilations`` counts the graphs it
built.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hyla.model.model import HylaLM
from hyla.model.state import SequenceState
from hyla.ops.attention import attention, attention_with_cache
from hyla.ops.gla import chunk_gla, gla_decode_step


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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
                 block_size: int = 16, num_snapshots: int = 0, compile: bool = False):
        self.model = model
        cfg = model.cfg
        p = model.embed.weight
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.pad_slot = max_num_seqs
        self.pad_block = num_kv_blocks
        self.gla_layers = [i for i, b in enumerate(model.blocks) if b.kind == "gla"]
        self.attn_layers = [i for i, b in enumerate(model.blocks) if b.kind != "gla"]
        if self.attn_layers and num_kv_blocks < 1:
            raise ValueError("the model has attention layers: num_kv_blocks must be >= 1")
        shape = (cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim)
        self.states = {i: torch.zeros(max_num_seqs + 1, *shape, device=self.device)
                       for i in self.gla_layers}
        self.snapshots = {i: torch.zeros(num_snapshots, *shape, device=self.device)
                          for i in self.gla_layers}
        kv_shape = (num_kv_blocks + 1, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k_cache = {i: torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
                        for i in self.attn_layers}
        self.v_cache = {i: torch.zeros(kv_shape, device=self.device, dtype=self.dtype)
                        for i in self.attn_layers}
        self.compiled = compile
        self._decode_fn = self._decode_impl
        if compile:
            from torch import _dynamo

            # Each decode shape is its own graph; the default limit (8) would fall back to
            # eager silently once more shapes were seen.
            _dynamo.config.recompile_limit = 1024
            _dynamo.config.accumulated_recompile_limit = 4096
            self._decode_fn = torch.compile(self._decode_impl, dynamic=False)
        self.num_compilations = 0      # graphs torch.compile built for decode
        self.compile_time_s = 0.0      # wall time of the decode calls that compiled

    # -- state movement ----------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        for i in self.gla_layers:
            self.states[i][slot].zero_()

    def copy_snapshots(self, pairs: list[tuple[int, int]], *, save: bool) -> None:
        """``save``: (state slot, snapshot slot) copies; else (snapshot slot, state slot)."""
        for a, b in pairs:
            for i in self.gla_layers:
                if save:
                    self.snapshots[i][b].copy_(self.states[i][a])
                else:
                    self.states[i][b].copy_(self.snapshots[i][a])

    def extract(self, slot: int, num_tokens: int, block_table: list[int]) -> SequenceState:
        """A standalone SequenceState (copies) of what a slot and its blocks hold."""
        tensors = []
        for i, block in enumerate(self.model.blocks):
            if block.kind == "gla":
                tensors.append((self.states[i][slot].clone(),))
            else:
                k, v = self.layer_kv(i, block_table, num_tokens)
                tensors.append((k.clone(), v.clone()))
        kinds = [b.kind for b in self.model.blocks]
        return SequenceState(kinds, tensors, num_tokens)

    def load(self, slot: int, state: SequenceState, block_table: list[int]) -> None:
        """Write a SequenceState (e.g. one shipped from a prefill worker) into a slot."""
        self.model._check_state(state, "state")
        n = state.num_tokens
        if self.attn_layers and len(block_table) * self.block_size < n:
            raise ValueError(f"block_table holds {len(block_table)} blocks: too few for "
                             f"{n} tokens")
        for i, ts in enumerate(state.tensors):
            if i in self.states:
                self.states[i][slot].copy_(ts[0])
            else:
                pos = torch.arange(n, device=self.device)
                blocks, offs = self._where(block_table, pos)
                self.k_cache[i][blocks, offs] = ts[0].to(self.device, self.dtype)
                self.v_cache[i][blocks, offs] = ts[1].to(self.device, self.dtype)

    # -- compute -----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, chunks: list[tuple[int, list[int], int, list[int]]],
                on_layer=None) -> torch.Tensor:
        """Compute prompt chunks of several sequences packed together.

        Args:
            chunks: (slot, token ids, start position, block table) per sequence; the slot
                holds the state after ``start`` tokens (zeroed by the caller for start 0).
            on_layer: optional ``fn(layer_index)`` called as soon as a layer's state is
                final, so a disaggregated prefill can ship it while later layers compute.
        Returns:
            logits [len(chunks), vocab] (fp32) at each chunk's last token.
        """
        m = self.model
        lens = [len(c[1]) for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c[1]], device=self.device)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=self.device)
        slots = torch.tensor([c[0] for c in chunks], device=self.device)
        positions = torch.cat([torch.arange(c[2], c[2] + n, device=self.device)
                               for c, n in zip(chunks, lens, strict=True)])
        x = m.embed(ids[None])
        for i, block in enumerate(m.blocks):
            h = block.mixer_norm(x)
            if block.kind == "gla":
                layer = block.mixer
                q, k, v, gk = layer._qkvg(h)
                o, final = chunk_gla(q, k, v, gk, initial_state=self.states[i][slots],
                                     output_final_state=True, cu_seqlens=cu,
                                     chunk_size=m.cfg.chunk_size)
                self.states[i].index_copy_(0, slots, final)
                y = layer._out(h, o)
            else:
                y = self._prefill_attention(i, block.mixer, h, positions, chunks, lens)
            if on_layer is not None:
                on_layer(i)
            x = x + y
            x = x + block.mlp(block.mlp_norm(x))
        last = cu[1:] - 1
        return m._logits(x[0, last]).float()

    def _prefill_attention(self, i, layer, h, positions, chunks, lens):
        q, k, v = layer._qkv(h, positions)
        blocks, offs = self._where_many([c[3] for c in chunks], chunks, lens)
        self.k_cache[i][blocks, offs] = k[0].to(self.dtype)
        self.v_cache[i][blocks, offs] = v[0].to(self.dtype)
        outs, s = [], 0
        for (_, _, start, table), n in zip(chunks, lens, strict=True):
            qc = q[:, s:s + n]
            if start == 0:
                o = attention(qc, k[:, s:s + n], v[:, s:s + n], causal=True)
            else:
                keys, values = self.layer_kv(i, table, start + n)
                o = attention_with_cache(qc, keys[None].to(q.dtype), values[None].to(q.dtype),
                                         torch.tensor([start + n]))
            outs.append(o)
            s += n
        return layer._out(torch.cat(outs, dim=1))

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int],
               block_tables: list[list[int]], width: int) -> torch.Tensor:
        """One token for each of B sequences.

        ``positions[b]`` is the token's position (tokens already in the state). Compiled,
        the batch is padded to ``width`` rows and the block tables to a power-of-two
        length, so the graph sees only those shapes; eager, it runs the B rows as they are
        (padding would only cost time). Returns logits [B, vocab] (fp32).
        """
        B = len(slots)
        if not 1 <= B <= width:
            raise ValueError(f"decode batch of {B} does not fit width {width}")
        rows = width if self.compiled else B
        pad = rows - B
        longest = max((len(t) for t in block_tables), default=0)
        nb = (_pow2(longest) if self.compiled else longest) if self.attn_layers else 0
        tables = torch.full((rows, nb), self.pad_block, dtype=torch.long)
        for b, t in enumerate(block_tables if nb else ()):
            tables[b, :len(t)] = torch.tensor(t, dtype=torch.long)
        dev = self.device
        args = (torch.tensor(list(tokens) + [0] * pad, device=dev),
                torch.tensor(list(slots) + [self.pad_slot] * pad, device=dev),
                torch.tensor(list(positions) + [0] * pad, device=dev),
                tables.to(dev))
        if not self.compiled:
            # Consecutive slots (the usual case: slots are handed out lowest first and the
            # engine sorts the batch) let GLA layers update their states in place.
            first = slots[0]
            span = slice(first, first + B) if list(slots) == list(range(first, first + B)) \
                else None
            return self._decode_impl(*args, span=span)
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        logits = self._decode_fn(*args)[:B]
        built = counters["stats"]["unique_graphs"] - before
        if built:
            self.num_compilations += built
            self.compile_time_s += time.perf_counter() - t0
        return logits

    def warmup(self, widths: tuple[int, ...], max_blocks: int = 0) -> int:
        """Build every decode graph up front: each width x each power-of-two block-table
        length up to ``max_blocks``. Writes only to the padding slot and block. Returns
        the number of graphs compiled."""
        before = self.num_compilations
        nbs = [0]
        if self.attn_layers:
            nbs = [1 << i for i in range(max(1, max_blocks).bit_length())]
            if nbs[-1] < max_blocks:
                nbs.append(nbs[-1] * 2)
        for w in widths:
            for nb in nbs:
                self.decode([self.pad_slot], [0], [0], [[self.pad_block] * nb], w)
        return self.num_compilations - before

    def _decode_impl(self, tokens, slots, positions, tables, span: slice | None = None):
        m = self.model
        x = m.embed(tokens[:, None])
        for i, block in enumerate(m.blocks):
            h = block.mixer_norm(x)
            if block.kind == "gla":
                layer = block.mixer
                q, k, v, gk = layer._qkvg(h)
                if span is not None:                              # a view: updated in place
                    o = gla_decode_step(q, k, v, gk, self.states[i][span])
                else:
                    state = self.states[i][slots]                 # gathered copy
                    o = gla_decode_step(q, k, v, gk, state)
                    self.states[i].index_copy_(0, slots, state)
                y = layer._out(h, o)
            else:
                y = self._decode_attention(i, block.mixer, h, positions, tables)
            x = x + y
            x = x + block.mlp(block.mlp_norm(x))
        return m._logits(x[:, 0]).float()

    def _decode_attention(self, i, layer, h, positions, tables):
        W = h.shape[0]
        q, k, v = layer._qkv(h, positions[:, None])
        bs = self.block_size
        rows = torch.arange(W, device=h.device)
        blocks = tables[rows, positions // bs]
        self.k_cache[i][blocks, positions % bs] = k[:, 0].to(self.dtype)
        self.v_cache[i][blocks, positions % bs] = v[:, 0].to(self.dtype)
        keys = self.k_cache[i][tables].flatten(1, 2).to(q.dtype)       # [W, nb * bs, Hkv, D]
        values = self.v_cache[i][tables].flatten(1, 2).to(q.dtype)
        # Inline masked SDPA: attention_with_cache's range checks would break the graph.
        mask = torch.arange(keys.shape[1], device=h.device)[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask[:, None, None],
                                           enable_gqa=keys.shape[2] != q.shape[2])
        return layer._out(o.transpose(1, 2))

    # -- paged addressing --------------------------------------------------------------
    def _where(self, table: list[int], pos: torch.Tensor):
        t = torch.tensor(table, dtype=torch.long, device=self.device)
        return t[pos // self.block_size], pos % self.block_size

    def _where_many(self, tables, chunks, lens):
        blocks, offs = [], []
        for table, (_, _, start, _), n in zip(tables, chunks, lens, strict=True):
            b, o = self._where(table, torch.arange(start, start + n, device=self.device))
            blocks.append(b)
            offs.append(o)
        return torch.cat(blocks), torch.cat(offs)

    def layer_kv(self, i: int, table: list[int], n: int):
        """Attention layer ``i``'s keys and values [n, H_kv, D] of the first n tokens of a
        block table (a gathered copy)."""
        blocks, offs = self._where(table, torch.arange(n, device=self.device))
        return self.k_cache[i][blocks, offs], self.v_cache[i][blocks, offs]
