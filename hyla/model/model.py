"""HylaLM: the hybrid language model, with its one block loop (and, where a checkpoint has
them, its multi-token-prediction layers, :mod:`hyla.model.mtp`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyla.model.block import Block
from hyla.model.config import HylaConfig
from hyla.model.context import Context
from hyla.model.layers import RMSNorm
from hyla.model.mixers import layer_specs
from hyla.model.mtp import MTPHead
from hyla.model.state import SequenceState


class HylaLM(nn.Module):
    """Hybrid linear-attention language model.

    - ``forward(input_ids [B, T], ctx=None) -> logits [B, T, vocab]``: the one block loop;
      the :class:`~hyla.model.context.Context` says whether the batch is training (the
      default, ``cu_seqlens`` for packed documents), prefill or decode;
    - ``prefill(input_ids [T], state) -> logits [T, vocab]``: fills/extends a SequenceState;
    - ``decode(token_ids [B], states) -> logits [B, vocab]``: one token for B sequences.

    Example:
        >>> from hyla.model.config import preset
        >>> model = HylaLM(preset("debug")).eval()
        >>> ids = torch.randint(0, 256, (7,))
        >>> full = model(ids[None])[0]
        >>> st = model.new_state()
        >>> _ = model.prefill(ids[:5], st)
        >>> step = model.decode(ids[5:6], [st])
        >>> torch.allclose(step[0], full[5], atol=1e-4), st.num_tokens
        (True, 6)
    """

    def __init__(self, cfg: HylaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, c, i) for i, c in enumerate(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, zero_centred=cfg.norm_zero_centred)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # drafts for speculative decoding only: the forward below never runs it
        self.mtp = MTPHead(cfg) if cfg.mtp_layers else None
        # Recompute each block in backward instead of keeping its activations (training only).
        self.activation_checkpointing = False
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.cfg.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, RMSNorm):
            nn.init.constant_(module.weight, 0.0 if module.zero_centred else 1.0)

    def num_parameters(self) -> int:
        """Number of parameters, tied embeddings counted once."""
        return sum(p.numel() for p in self.parameters())

    @property
    def state_specs(self):
        """One :class:`~hyla.model.mixers.StateSpec` per layer (made once: parsing each
        layer's options on every ``decode`` call cost Granite-4.0-H 20 ms a token)."""
        specs = self.__dict__.get("_state_specs")
        if specs is None or specs[0] is not self.cfg:
            specs = self.__dict__["_state_specs"] = (self.cfg, layer_specs(self.cfg))
        return specs[1]

    @property
    def anchor(self) -> torch.Tensor:
        """A weight in the model's compute dtype and on its device, whatever else happens to
        the weights (quantisation replaces the embedding and the linear layers)."""
        return self.norm.weight

    def new_state(self) -> SequenceState:
        """An empty SequenceState on this model's device, caches in its dtype."""
        p = self.anchor
        return SequenceState.empty(self.cfg, device=p.device, dtype=p.dtype)

    def forward(self, input_ids: torch.Tensor, ctx: Context | None = None, *,
                cu_seqlens: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
        """input_ids [B, T] long -> logits [B, T, vocab] (``ctx.logits_at`` picks rows).

        Without ``ctx`` the batch is training data; with ``cu_seqlens`` (int [N + 1],
        B == 1) the row is N packed documents: linear states reset, attention is masked and
        rotary positions restart at each boundary. ``hidden``: return the final normed
        hidden states [B, T, d_model] instead of logits (what ``lm_head`` maps to logits,
        ``cfg.logit_scale`` already in them).
        """
        if ctx is None:
            ctx = Context.train(input_ids, cu_seqlens)
        elif cu_seqlens is not None:
            raise ValueError("pass cu_seqlens inside the Context, not beside it")
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, ctx, use_reentrant=False)
            else:
                x = block(x, ctx)
        if ctx.logits_at is not None:
            x = x[:, ctx.logits_at]
        x = self.norm(x)
        if self.cfg.logit_scale != 1.0:     # in the hidden states, so lm_head(hidden) has it
            x = x * self.cfg.logit_scale
        return x if hidden else self.lm_head(x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The blocks' input: the embedding rows, times ``cfg.embedding_scale``."""
        x = self.embed(input_ids)
        return x if self.cfg.embedding_scale == 1.0 else x * self.cfg.embedding_scale

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Run a prompt (or its next chunk) through the model, extending ``state`` in place.

        Args:
            input_ids: [T] (or [1, T]) long, T >= 1.
            state: a SequenceState for this model; it may already hold tokens, in which case
                the prompt continues after them.
        Returns:
            logits [T, vocab].
        """
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be [T] or [1, T] with T >= 1, "
                             f"got {tuple(input_ids.shape)}")
        self.check_state(state, "state")
        T, S = input_ids.numel(), state.num_tokens
        buffers = state.as_buffers([state], self.state_specs, extra_rows=T)
        ctx = Context.prefill([S], [T], [0], [[0]], buffers, block_size=S + T,
                              device=input_ids.device, last_logits=False)
        logits = self(input_ids[None], ctx)[0]
        state.take_buffers([state], buffers, self.state_specs, [S + T])
        return logits

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, states: list[SequenceState]) -> torch.Tensor:
        """Advance B sequences by one token each, in place.

        Args:
            token_ids: [B] long, the next token of each sequence.
            states: B distinct SequenceStates (they may hold different numbers of tokens).
        Returns:
            logits [B, vocab].
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [B], got {tuple(token_ids.shape)}")
        if len(states) != token_ids.numel():
            raise ValueError(f"states must hold one SequenceState per token "
                             f"({token_ids.numel()}), got {len(states)}")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("states must be distinct SequenceState objects")
        for b, s in enumerate(states):
            self.check_state(s, f"states[{b}]")
        B, dev = len(states), token_ids.device
        lens = [s.num_tokens for s in states]
        width = max(lens) + 1     # one "block" per sequence, long enough for all of them
        buffers = SequenceState.as_buffers(states, self.state_specs, extra_rows=width - 1,
                                           block_rows=width)
        ctx = Context.decode(torch.arange(B, device=dev), torch.tensor(lens, device=dev),
                             torch.arange(B, device=dev)[:, None], buffers, block_size=width,
                             slot_span=slice(0, B))
        logits = self(token_ids[:, None], ctx)[:, 0]
        SequenceState.take_buffers(states, buffers, self.state_specs, [n + 1 for n in lens])
        return logits

    def check_state(self, state: SequenceState, name: str = "state") -> None:
        """ValueError naming ``name`` unless ``state`` fits this model's layers."""
        specs = self.state_specs
        problem = state.mismatch(specs) if isinstance(state, SequenceState) \
            else f"got {type(state).__name__}"
        if problem:
            raise ValueError(f"{name} must be a SequenceState with layer kinds "
                             f"{[s.kind for s in specs]} (use model.new_state()): {problem}")
