"""Multi-token prediction (MTP) layers, as Qwen3-Next and Qwen3.5 ship them (DeepSeek-V3's
design): a head that predicts the token after next from the model's final hidden state at
position p and the embedding of token p + 1.

    x = fc([norm_e(embed(t[p + 1])) ; norm_h(h[p])])      fc: 2 d_model -> d_model
    g = norm(block(x))                                    one softmax-attention block
    logits = lm_head(g)                                   the model's own embed and lm_head

The block is built like the stack's last softmax-attention layer (its heads, gate, rotary,
norms and FFN kind, :func:`mtp_config`) and keeps keys and values of its own. Drafting k
tokens (vLLM's recipe for these families): the head consumes every position the target has
computed, then runs on its own output, ``g`` standing for ``h``, once per further draft.
The model's forward never runs it: it serves only speculative decoding (``--speculative
mtp``, :class:`hyla.serve.mtp_drafter.MTPDrafter`).

Example:
    >>> import torch
    >>> from hyla.model import HylaLM
    >>> from hyla.model.config import HylaConfig
    >>> cfg = HylaConfig(vocab_size=64, d_model=32, layers="GA", n_heads=4, ffn_dim=64,
    ...                  mtp_layers=1)
    >>> model = HylaLM(cfg).eval()
    >>> state = MTPState(model)
    >>> h = model(torch.tensor([[1, 2, 3]]), hidden=True)[0]
    >>> state.run([2, 3, 4], h).shape, state.num_tokens    # pairs (h[p], t[p + 1])
    (torch.Size([3, 32]), 3)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyla.model.block import Block
from hyla.model.config import HylaConfig
from hyla.model.context import Context
from hyla.model.layers import RMSNorm
from hyla.model.mixers import layer_specs


def mtp_config(cfg: HylaConfig) -> HylaConfig:
    """The config of ``cfg``'s MTP layers: a copy of one stack layer's, window included
    (``cfg.mtp_options["like"]``; default the last softmax-attention layer), one layer (and
    its FFN kind, or ``mtp_options["ffn"]``) per MTP layer."""
    o = cfg.mtp_options
    at = o.get("like", cfg.layers.rindex("A"))
    n = max(1, cfg.mtp_layers)
    return dataclasses.replace(cfg.layer_config(at), layers="A" * n,
                               ffn_layers=o.get("ffn", cfg.ffn_letter(at)) * n,
                               layer_overrides=None, mtp_layers=0, mtp_options={})


class MTPHead(nn.Module):
    """A model's MTP layers (``cfg.mtp_layers`` of them; the names are the checkpoints'
    ``mtp.*`` ones). ``forward(embeds, hidden, ctx, layer)`` -> ``g`` [B, T, d_model].
    With ``mtp_options["per_layer_fusion"]`` the fusion (``fc`` and its two norms) and the
    final ``norm`` are lists, one a layer."""

    def __init__(self, cfg: HylaConfig):
        super().__init__()
        self.cfg = mtp_config(cfg)
        d, eps, zc = cfg.d_model, cfg.norm_eps, cfg.norm_zero_centred
        per_layer = cfg.mtp_options.get("per_layer_fusion", False)

        def one(make):
            return nn.ModuleList(make() for _ in range(cfg.mtp_layers)) if per_layer \
                else make()

        self.fc = one(lambda: nn.Linear(2 * d, d, bias=False))
        self.pre_fc_norm_embedding = one(lambda: RMSNorm(d, eps=eps, zero_centred=zc))
        self.pre_fc_norm_hidden = one(lambda: RMSNorm(d, eps=eps, zero_centred=zc))
        self.layers = nn.ModuleList(Block(self.cfg, "A", i) for i in range(cfg.mtp_layers))
        self.norm = one(lambda: RMSNorm(d, eps=eps, zero_centred=zc))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: Context,
                layer: int = 0) -> torch.Tensor:
        def at(m):
            return m[layer] if isinstance(m, nn.ModuleList) else m

        x = torch.cat([at(self.pre_fc_norm_embedding)(embeds),
                       at(self.pre_fc_norm_hidden)(hidden)], dim=-1)
        return at(self.norm)(self.layers[layer](at(self.fc)(x), ctx))


class MTPState:
    """One sequence's keys and values in a model's first MTP layer (the one that drafts:
    each further draft runs it again, as vLLM does for these families), and the runs that
    extend it. They live in one buffer that doubles when full, so a draft step writes its
    row in place (no copy of the state a step), and a draft's rows are taken back by
    length. A window layer (MiMo-V2-Flash's) keeps its rows there too: each run sees a
    ring built from the window before it, so what is taken back never hides a row; and a
    :meth:`truncate` (the drafts taken back) forgets the rows a window before the length
    it keeps, so its buffer stays a few windows long however long the sequence.

    Its rows are positions ``base, base + 1, ...`` of the target's sequence; rotary
    attention depends only on distances, so a state that starts late (``base`` > 0) is one
    that has forgotten the positions before it."""

    def __init__(self, model, base: int = 0, capacity: int = 256):
        if getattr(model, "mtp", None) is None:
            raise ValueError("the model has no multi-token-prediction layers (mtp_layers=0)")
        self.model, self.base, self.num_tokens = model, base, 0
        self.forgotten = 0      # a window layer's rows before the buffer's first (see truncate)
        spec = layer_specs(model.mtp.cfg)[0]
        self.window = spec.window
        if spec.fixed and self.window is None:
            raise ValueError("an MTP layer with fixed-size state cannot take drafts back")
        # one token's row of each tensor (a ring's entries are [window, *row])
        self.rows = [(e.name, e.shape[1:] if self.window else e.shape, e.dtype)
                     for e in spec.fixed or spec.per_token]
        self.buffers = self._alloc(capacity)

    def _alloc(self, rows: int) -> list[dict[str, torch.Tensor]]:
        p = self.model.anchor
        return [{name: torch.zeros(1, rows, *shape, dtype=dtype or p.dtype, device=p.device)
                 for name, shape, dtype in self.rows}]

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers[0].values())).shape[1]

    def nbytes(self) -> int:
        """The bytes its buffer holds (what ``hyla serve``'s memory line counts)."""
        return sum(t.numel() * t.element_size() for layer in self.buffers
                   for t in layer.values())

    @torch.no_grad()
    def run(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Extend the state by pairs ``(hidden[i], next_ids[i])``: the target's final
        hidden state at a position (or the head's own ``g`` there) and the token after it.
        Returns ``g`` [len(next_ids), d_model], whose ``lm_head`` drafts the token after
        each ``next_ids[i]``."""
        S, T = self.num_tokens, len(next_ids)
        if T == 0 or hidden.shape[0] != T:
            raise ValueError(f"expected one hidden row per token, got {hidden.shape[0]} rows "
                             f"for {T} tokens")
        held = S - self.forgotten
        if held + T > self.capacity:
            grown = self._alloc(max(2 * self.capacity, held + T))
            for name, t in self.buffers[0].items():
                grown[0][name][:, :held] = t[:, :held]
            self.buffers = grown
        if self.window is None:
            return self._extend(next_ids, hidden, self.buffers)
        W = self.window          # chunks of at most W rows: each one's rows all reach the ring
        return torch.cat([self._run_ring(next_ids[c:c + W], hidden[c:c + W])
                          for c in range(0, T, W)])

    def _extend(self, next_ids: list[int], hidden: torch.Tensor, buffers) -> torch.Tensor:
        model, S, T = self.model, self.num_tokens, len(next_ids)
        p = model.anchor
        ids = torch.tensor(next_ids, device=p.device)
        ctx = Context.prefill([S], [T], [0], [[0]], buffers,
                              block_size=max(self.capacity, S + T), device=p.device,
                              last_logits=False)
        g = model.mtp(model.embed_tokens(ids[None]), hidden[None].to(p.dtype), ctx)[0]
        self.num_tokens = S + T
        return g

    def _run_ring(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """One run of at most ``window`` pairs through a window layer: the ring holds the
        rows of the window before them, then gives their rows back to the buffer."""
        S, T, W = self.num_tokens, len(next_ids), self.window
        buf, f = self.buffers[0], self.forgotten
        dev = next(iter(buf.values())).device
        held = torch.arange(max(0, S - W), S, device=dev)
        ring = {}
        for name, t in buf.items():
            ring[name] = t.new_zeros(1, W, *t.shape[2:])
            ring[name][0, held % W] = t[0, held - f]
        g = self._extend(next_ids, hidden, [ring])
        new = torch.arange(S, S + T, device=dev)
        for name, t in buf.items():
            t[0, new - f] = ring[name][0, new % W]
        return g

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` rows (drafts' rows are taken back this way: rows
        past them are overwritten by the next run)."""
        least = self.forgotten + (self.window or 0) if self.forgotten else 0
        if not least <= num_tokens <= self.num_tokens:
            raise ValueError(f"num_tokens must be in [{least}, {self.num_tokens}] (a window "
                             f"layer forgets rows a window before a length it kept), got "
                             f"{num_tokens}")
        self.num_tokens = num_tokens
        W = self.window
        if W and num_tokens - W - self.forgotten >= self.capacity // 2:
            # rows before num_tokens - W are read by no later run: move the window to the
            # buffer's front (amortised: at most every capacity / 2 rows)
            keep = num_tokens - W
            for t in self.buffers[0].values():
                t[:, :W] = t[:, keep - self.forgotten:num_tokens - self.forgotten].clone()
            self.forgotten = keep
