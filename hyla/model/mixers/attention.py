"""``A``: softmax attention with rotary positions and grouped-query heads.

State per sequence: its keys and values, one [n_kv_heads, head_dim] key row and one
[n_kv_heads, value_head_dim] value row per token, in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import RMSNorm, norm_weight, rotate, shared_rotary_tables
from hyla.model.mixers.base import Mixer, StateSpec, TensorSpec, merge_kv_heads, register_mixer
from hyla.ops.attention import attention, attention_with_cache, masked_attention, with_sinks
from hyla.ops.paged_attention import attend_compiled, attend_gathered, attend_spans
from hyla.ops.window_attention import ring_positions, visible


@dataclass(frozen=True)
class AttentionOptions:
    """``cfg.mixer_options["attention"]``: what the transformers families add to plain
    attention. The defaults are hyla's own ``A``. Per-layer values (MiMo-V2-Flash's window
    layers) go in ``cfg.layer_overrides``, like the heads, head dim, rope theta and window.

    - ``output_gate``: the q projection yields a query and a gate for each head, laid out
      per head as ``[query (head_dim), gate (head_dim)]``; the output is
      ``o_proj(attn * sigmoid(gate))`` (Qwen3-Next / Qwen3.5's attention,
      ``attn_output_gate``);
    - ``partial_rotary_factor``: rotary on the first ``int(head_dim * factor)`` dims of each
      head only (even), the rest unrotated; its frequencies are those of a head of that
      size (transformers' ``partial_rotary_factor`` in ``rope_parameters`` or the config);
    - ``rotary``: False for no positional encoding at all (NoPE: OLMo hybrid's released
      checkpoints, ``rope_parameters`` None);
    - ``qk_norm_scope`` (with ``cfg.qk_norm``): ``"head"`` one RMSNorm over each head's
      dims, shared by the heads (Qwen3, Qwen3-Next); ``"all"`` one RMSNorm over the whole
      q projection and one over the whole k projection, before the split into heads
      (OLMo 2/3 and OLMo hybrid's ``q_norm``/``k_norm``);
    - ``value_head_dim``: the head dim of the values and the attention output, when it
      differs from the query/key head dim ``cfg.head_dim`` (MiMo-V2-Flash's ``v_head_dim``);
    - ``value_scale``: values are multiplied by it before attention, and cached so
      (MiMo-V2-Flash's ``attention_value_scale``);
    - ``sinks``: a learned logit per query head (parameter ``sinks`` [n_heads]) that joins
      every softmax row without a value (MiMo-V2-Flash's window layers, gpt-oss);
    - ``softmax_scale``: the scores' scale (None: ``head_dim ** -0.5``; Granite's
      ``attention_multiplier``), applied to the queries so every attention path keeps its
      default scale.

    Example:
        >>> from hyla.model.config import HylaConfig
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="A", n_heads=4, ffn_dim=128,
        ...                  mixer_options={"attention": {"output_gate": True}})
        >>> AttentionMixer(cfg).q_proj.weight.shape
        torch.Size([128, 64])
    """

    output_gate: bool = False
    partial_rotary_factor: float = 1.0
    rotary: bool = True
    qk_norm_scope: str = "head"
    value_head_dim: int | None = None
    value_scale: float = 1.0
    sinks: bool = False
    softmax_scale: float | None = None

    def __post_init__(self):
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], "
                             f"got {self.partial_rotary_factor}")
        if self.qk_norm_scope not in ("head", "all"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'all', got {self.qk_norm_scope!r}")
        if self.softmax_scale is not None and not 0 < self.softmax_scale < float("inf"):
            raise ValueError(f"softmax_scale must be a positive number or None, "
                             f"got {self.softmax_scale}")
        if self.value_head_dim is not None and self.value_head_dim <= 0:
            raise ValueError(f"value_head_dim must be a positive int or None, "
                             f"got {self.value_head_dim}")


@register_mixer("A")
class AttentionMixer(Mixer):
    """Causal softmax attention (``cfg.n_kv_heads`` key/value heads, Llama's rotary layout).

    What the transformers families need is configuration (:class:`~hyla.model.HylaConfig`):
    q/k/v biases (``attention_bias``) and an o bias (``attention_out_bias``), RMSNorm on q
    and k before rotary (``qk_norm``; zero-centred with ``norm_zero_centred``), a head dim of
    its own (``attention_head_dim``), scaled RoPE (``rope_scaling``) and a causal sliding
    window (``sliding_window``: training, prefill and decode alike; such a layer keeps its
    last ``sliding_window`` keys and values in a ring, fixed memory however long the
    context, instead of paged KV that grows), plus :class:`AttentionOptions` (output gate,
    partial rotary, NoPE, whole-projection q/k norms, a value head dim, a value scale,
    sinks).

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model.context import Context
        >>> layer = AttentionMixer(preset("debug"))
        >>> ids = torch.zeros(2, 5, dtype=torch.long)
        >>> layer(torch.randn(2, 5, 64), Context.train(ids)).shape
        torch.Size([2, 5, 64])
    """

    kind = "attention"
    state_label = "attention KV"
    options_class = AttentionOptions

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        o = self.opts
        d, hd, vd = cfg.d_model, cfg.head_dim, self.value_head_dim(cfg)
        q_out = cfg.n_heads * hd * (2 if o.output_gate else 1)
        self.q_proj = nn.Linear(d, q_out, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * vd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.n_heads * vd, d, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            whole = o.qk_norm_scope == "all"
            z = cfg.norm_zero_centred
            self.q_norm = RMSNorm(cfg.n_heads * hd if whole else hd, eps=cfg.norm_eps,
                                  zero_centred=z)
            self.k_norm = RMSNorm(cfg.kv_dim if whole else hd, eps=cfg.norm_eps, zero_centred=z)
        if o.sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))
        # read every step: parsing the options again (rotary_dim) cost ~1 ms a layer a token
        self.rot_dim = self.rotary_dim(cfg)

    @classmethod
    def value_head_dim(cls, cfg) -> int:
        """The head dim of this layer's values (``value_head_dim`` or ``cfg.head_dim``)."""
        return cls.options(cfg).value_head_dim or cfg.head_dim

    @classmethod
    def rotary_dim(cls, cfg) -> int:
        """How many leading dims of each q/k head rotary turns (0 without rotary)."""
        o = cls.options(cfg)
        return int(cfg.head_dim * o.partial_rotary_factor) if o.rotary else 0

    @classmethod
    def check_config(cls, cfg) -> None:
        o = cls.options(cfg)
        if o.rotary and cls.rotary_dim(cfg) % 2:
            raise ValueError(f"mixer_options['attention']: partial_rotary_factor="
                             f"{o.partial_rotary_factor} gives {cls.rotary_dim(cfg)} rotary "
                             f"dims of head_dim={cfg.head_dim}: expected an even number")
        if o.output_gate and cls.value_head_dim(cfg) != cfg.head_dim:
            raise ValueError("mixer_options['attention']: output_gate needs value_head_dim "
                             "equal to the head dim (the gate has head_dim per head)")

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        keys, values = (cfg.n_kv_heads, cfg.head_dim), (cfg.n_kv_heads, cls.value_head_dim(cfg))
        w = cfg.sliding_window
        if w is not None:       # a ring: row p % w holds position p
            return StateSpec(cls.kind, fixed=(TensorSpec("keys", (w, *keys)),
                                              TensorSpec("values", (w, *values))), window=w)
        return StateSpec(cls.kind, per_token=(TensorSpec("keys", keys),
                                              TensorSpec("values", values)))

    @classmethod
    def pair_flops(cls, cfg) -> float:
        return 2 * cfg.n_heads * (cfg.head_dim + cls.value_head_dim(cfg))   # QK^T and PV

    @classmethod
    def copies_attention(cls, teacher_cfg, cfg) -> bool:
        return (cfg.n_kv_heads == teacher_cfg.n_kv_heads
                and cls.options(cfg) == cls.options(teacher_cfg))

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """Copy the teacher's attention. With fewer KV heads (KV-cache compression) each KV
        head is the mean of the group of teacher KV heads it replaces: query head ``h`` read
        teacher KV head ``h // (H / H_kv)``, which falls in group ``h // (H / H_s)``, so every
        query keeps reading a merge of the head it used to read. Rotary is linear and the
        same for every head, so the merged rotated key is the rotated merged key (biases
        merge the same way; q/k norms are per head dim, shared by all heads).

        What a shipped layout adds (Qwen3.5's, :func:`hyla.train.distill.student`) starts
        where it changes nothing or least: an output gate whose rows are zero (every output
        halved by ``sigmoid(0)``, so ``o_proj`` is doubled: exact); q/k norms the teacher
        lacks at unit scale, until :meth:`calibrate` sets them from the teacher's queries
        and keys; norm weights converted between plain and zero-centred storage."""
        heads, new = teacher.cfg.n_kv_heads, self.cfg.n_kv_heads
        # (the linearised mixers built on this one have options of their own kind)
        gated = getattr(self.opts, "output_gate", False) and not getattr(
            teacher.opts, "output_gate", False)
        self.fresh_qk_norm = self.cfg.qk_norm and not teacher.cfg.qk_norm
        for name, tensor in teacher.state_dict().items():
            if name.startswith(("k_proj.", "v_proj.")) and heads != new:
                flat = tensor[:, None] if tensor.dim() == 1 else tensor
                tensor = merge_kv_heads(flat, heads, new).reshape(-1, *tensor.shape[1:])
            if gated and name.startswith("q_proj."):     # per head: [query, gate]
                q = tensor.reshape(self.cfg.n_heads, self.cfg.head_dim, *tensor.shape[1:])
                tensor = torch.cat([q, torch.zeros_like(q)], dim=1).reshape(
                    -1, *tensor.shape[1:])
            if gated and name == "o_proj.weight":
                tensor = 2 * tensor
            if name.endswith("_norm.weight"):
                tensor = norm_weight(tensor, teacher.get_submodule(name[:-7]),
                                     self.get_submodule(name[:-7]))
            self.get_parameter(name).copy_(tensor)

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> dict:
        """q/k norms this layer has and its teacher had not: scaled to the teacher's mean
        query and key norms (q [B, T, H, D], k [B, T, H_kv, D], its rotated queries and
        keys: rotation keeps each head's norm), so attention's logits start near the
        teacher's. Returns the scales; nothing for a layer without such norms."""
        if not getattr(self, "fresh_qk_norm", False):
            return {}
        found = {}
        for name, x in (("q_norm", q), ("k_norm", k)):
            scale = x.float().pow(2).mean(-1).sqrt().mean()
            norm = getattr(self, name)
            norm.weight.fill_(float(scale) - 1.0 if norm.zero_centred else float(scale))
            found[name] = float(scale)
        return found

    def _project(self, x: torch.Tensor, positions: torch.Tensor, lengths=None,
                 memo: dict | None = None):
        """q, k [B, T, H(_kv), head_dim] (normed, rotated), v [B, T, H_kv, value_head_dim]
        (scaled) and the output gate [B, T, H * head_dim] (None without one). ``memo``: the
        forward's :attr:`Context.memo`, where the rotary tables are shared."""
        B, T, _ = x.shape
        c, o = self.cfg, self.opts
        q, gate = self.q_proj(x), None
        if o.output_gate:       # per head: [query, gate], as Qwen3-Next lays q_proj out
            q, gate = q.view(B, T, c.n_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        k = self.k_proj(x)
        if c.qk_norm and o.qk_norm_scope == "all":
            q, k = self.q_norm(q.reshape(B, T, -1)), self.k_norm(k)
        q = q.reshape(B, T, c.n_heads, c.head_dim)
        k = k.view(B, T, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, -1)
        if o.value_scale != 1.0:
            v = v * o.value_scale
        if c.qk_norm and o.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if o.softmax_scale is not None:     # rotation is linear: scaling before it is the same
            q = q * (o.softmax_scale * c.head_dim ** 0.5)
        if T == 1:      # decode: one rotation of q and k together (one cos/sin), fewer ops
            qk = self._rotate(torch.cat([q, k], dim=2), positions, lengths, memo)
            q, k = qk.split([c.n_heads, c.n_kv_heads], dim=2)
            return q, k, v, gate
        return (self._rotate(q, positions, lengths, memo),
                self._rotate(k, positions, lengths, memo), v, gate)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, lengths,
                memo: dict | None = None) -> torch.Tensor:
        c = self.cfg
        rot = self.rot_dim
        if rot == 0:
            return x
        tables = shared_rotary_tables(memo, positions, rot, c.rope_theta, c.rope_scaling,
                                      lengths, device=x.device)
        if rot == c.head_dim:
            return rotate(x, tables)
        return torch.cat([rotate(x[..., :rot], tables), x[..., rot:]], dim=-1)

    def _output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        o = o.reshape(*o.shape[:2], -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def _rope_lengths(self, ctx) -> torch.Tensor | None:
        """Dynamic RoPE rescales by the length a forward sees (transformers'
        ``max(position_ids) + 1``): the whole batch in training, each chunk's end in
        prefill, each token's own in decode. Other RoPE kinds do not need it."""
        scaling = self.cfg.rope_scaling
        if not scaling or scaling.get("rope_type") != "dynamic":
            return None
        pos = ctx.positions
        if ctx.mode == "train":
            return (pos.max() + 1).expand_as(pos)
        if ctx.mode == "prefill":
            ends = torch.tensor([s + n for s, n in zip(ctx.starts, ctx.lengths, strict=True)],
                                device=pos.device)
            return ends.repeat_interleave(torch.tensor(ctx.lengths, device=pos.device))
        return pos + 1

    def attention_qk(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _, _ = self._project(x, ctx.positions, self._rope_lengths(ctx), ctx.memo)
        return q, k

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.mode == "decode":
            return self._attend_step(x, ctx)
        q, k, v, gate = self._project(x, ctx.positions, self._rope_lengths(ctx), ctx.memo)
        if ctx.mode == "train":
            o = attention(q, k, v, causal=True, cu_seqlens=ctx.cu_seqlens,
                          window=self.cfg.sliding_window, sinks=self._sinks())
        else:
            o = self._attend_chunks(q, k, v, ctx)
        return self._output(o, gate)

    def _sinks(self) -> torch.Tensor | None:
        return self.sinks if self.opts.sinks else None

    def _attend_chunks(self, q, k, v, ctx) -> torch.Tensor:
        if self.cfg.sliding_window is not None:
            return self._ring_chunks(q, k, v, ctx)
        buf = ctx.buffers[self.layer_idx]
        ctx.append_rows(buf["keys"], k[0])
        ctx.append_rows(buf["values"], v[0])
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            qc = q[:, s:s + n]
            if start == 0:      # the chunk is all there is: attend to its fresh keys
                o = attention(qc, k[:, s:s + n], v[:, s:s + n], causal=True,
                              sinks=self._sinks())
            else:
                keys = ctx.sequence_rows(buf["keys"], j, start + n)[None].to(q.dtype)
                values = ctx.sequence_rows(buf["values"], j, start + n)[None].to(q.dtype)
                o = attention_with_cache(qc, keys, values, torch.tensor([start + n]),
                                         sinks=self._sinks())
            outs.append(o)
            s += n
        return torch.cat(outs, dim=1)

    def _ring_chunks(self, q, k, v, ctx) -> torch.Tensor:
        """Prefill of a sliding-window layer: each chunk sees what its sequence's ring holds
        (the window before it) and itself; its last ``window`` rows then go to the ring."""
        buf, W = ctx.buffers[self.layer_idx], self.cfg.sliding_window
        outs, s = [], 0
        for j, (start, n) in enumerate(zip(ctx.starts, ctx.lengths, strict=True)):
            sl, row, pos = slice(s, s + n), ctx.slots[j], ctx.positions[s:s + n]
            if start == 0:
                o = attention(q[:, sl], k[:, sl], v[:, sl], causal=True, window=W,
                              sinks=self._sinks())
            else:
                held = ring_positions(pos[:1] - 1, W)[0]
                keys = torch.cat([buf["keys"][row].to(q.dtype), k[0, sl]])[None]
                values = torch.cat([buf["values"][row].to(q.dtype), v[0, sl]])[None]
                mask = visible(pos, torch.cat([held, pos]), W, 0)
                o = masked_attention(q[:, sl], keys, values, mask, sinks=self._sinks())
            keep = slice(max(0, n - W), n)          # only the last W reach the ring
            for name, x in (("keys", k), ("values", v)):
                buf[name][row, pos[keep] % W] = x[0, sl][keep].to(buf[name].dtype)
            outs.append(o)
            s += n
        return torch.cat(outs, dim=1)

    def _attend_step(self, x, ctx) -> torch.Tensor:
        buf = ctx.buffers[self.layer_idx]
        positions = ctx.positions
        lengths = self._rope_lengths(ctx)
        q, k, v, gate = self._project(x, positions[:, None],
                                      None if lengths is None else lengths[:, None], ctx.memo)
        if self.cfg.sliding_window is not None:
            return self._output(self._ring_step(q, k, v, ctx), gate)
        ctx.append_rows(buf["keys"], k[:, 0])
        ctx.append_rows(buf["values"], v[:, 0])
        if not self.opts.sinks:
            # every row of its sequence is visible to the query: read them in place, as
            # views the engine worked out (eager), or inside one op when compiled (the graph
            # then does not depend on the block tables' length: one for every context)
            keys, values = buf["keys"], buf["values"]
            if ctx.kv_spans is not None:
                o = attend_spans(q, keys, values, ctx.kv_spans)
            elif torch.compiler.is_compiling():
                o = attend_compiled(q, keys, values, ctx.block_tables, positions)
            else:                                               # wide batches
                o = attend_gathered(q, keys, values, ctx.block_tables, positions)
            return self._output(o, gate)
        keys = ctx.batch_rows(buf["keys"]).to(q.dtype)      # [B, blocks * bs, Hkv, D]
        values = ctx.batch_rows(buf["values"]).to(q.dtype)
        key_pos = torch.arange(keys.shape[1], device=x.device)[None, :]
        return self._output(self._masked_step(q, keys, values, key_pos <= positions[:, None]),
                            gate)

    def _masked_step(self, q, keys, values, mask) -> torch.Tensor:
        """One query a sequence over its keys, ``mask`` [B, S] saying which are real. Inline
        SDPA: attention_with_cache's range checks would break a compiled graph."""
        mask, scale = mask[:, None, None], None
        if self.opts.sinks:
            q, keys, values, mask, scale = with_sinks(q, keys, values, mask, self.sinks)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=mask, scale=scale,
                                           enable_gqa=keys.shape[2] != q.shape[2])
        return o.transpose(1, 2)

    def _ring_step(self, q, k, v, ctx) -> torch.Tensor:
        """Decode of a sliding-window layer: the new row goes to its place in the ring,
        then the query reads the whole ring, which then holds exactly its window (rows not
        written yet are masked; order does not matter to softmax). Tensors only."""
        buf, W, P = ctx.buffers[self.layer_idx], self.cfg.sliding_window, ctx.positions
        for name, x in (("keys", k), ("values", v)):
            buf[name][ctx.slots, P % W] = x[:, 0].to(buf[name].dtype)
        rows = ctx.slots if ctx.slot_span is None else ctx.slot_span
        key = ("ring mask", W)          # the same for every layer of this window
        mask = ctx.memo.get(key)
        if mask is None:
            mask = ctx.memo[key] = ring_positions(P, W) >= 0
        return self._masked_step(q, buf["keys"][rows].to(q.dtype),
                                 buf["values"][rows].to(q.dtype), mask)
