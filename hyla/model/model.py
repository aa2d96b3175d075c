"""HylaLM: the hybrid GLA / softmax-attention language model and its three entry points."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyla.model.config import LAYER_KINDS, HylaConfig
from hyla.model.layers import AttentionLayer, GLALayer, RMSNorm, SwiGLU
from hyla.model.state import SequenceState
from hyla.ops.attention import check_cu_seqlens


class Block(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: HylaConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = GLALayer(cfg) if kind == "gla" else AttentionLayer(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Training form: x [B, T, d_model] -> [B, T, d_model]."""
        h = self.mixer_norm(x)
        if self.kind == "gla":
            x = x + self.mixer(h, cu_seqlens=cu_seqlens)
        else:
            x = x + self.mixer(h, positions, cu_seqlens=cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class HylaLM(nn.Module):
    """Hybrid linear-attention language model.

    - ``forward(input_ids [B, T], cu_seqlens=None) -> logits [B, T, vocab]``: training;
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
        self.blocks = nn.ModuleList(Block(cfg, LAYER_KINDS[c]) for c in cfg.layers)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
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
            nn.init.ones_(module.weight)

    def num_parameters(self) -> int:
        """Number of parameters, tied embeddings counted once."""
        return sum(p.numel() for p in self.parameters())

    def new_state(self) -> SequenceState:
        """An empty SequenceState on this model's device, caches in its dtype."""
        p = self.embed.weight
        return SequenceState.empty(self.cfg, device=p.device, dtype=p.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Training forward: input_ids [B, T] long -> logits [B, T, vocab].

        With ``cu_seqlens`` (int [N + 1], B == 1) the batch row is N packed documents: GLA
        state resets, attention is masked and rotary positions restart at each boundary.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        if cu_seqlens is not None:
            offsets = check_cu_seqlens(cu_seqlens, B, T)
            starts = torch.tensor(offsets[:-1], device=input_ids.device)
            lengths = torch.tensor([e - s for s, e in zip(offsets[:-1], offsets[1:],
                                                              strict=True)],
                                   device=input_ids.device)
            positions = positions - starts.repeat_interleave(lengths)
            cu_seqlens = cu_seqlens.to(input_ids.device)
        x = self.embed(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, positions, cu_seqlens, use_reentrant=False)
            else:
                x = block(x, positions, cu_seqlens)
        return self._logits(x)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Run a prompt (or its next chunk) through the model, extending ``state`` in place.

        Args:
            input_ids: [T] (or [1, T]) long, T >= 1.
            state: a SequenceState for this model; it may already hold tokens, in which case
                the prompt continues after them (GLA from the stored matrix, attention over
                the cached keys, rotary positions from ``state.num_tokens``).
        Returns:
            logits [T, vocab].
        """
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be [T] or [1, T] with T >= 1, "
                             f"got {tuple(input_ids.shape)}")
        self._check_state(state, "state")
        x = self.embed(input_ids[None])
        for i, block in enumerate(self.blocks):
            h = block.mixer_norm(x)
            if block.kind == "gla":
                y, new = block.mixer.prefill(h, state.tensors[i][0])
                state.tensors[i][0].copy_(new)
            else:
                y, keys, values = block.mixer.prefill(h, *state.tensors[i])
                state.tensors[i] = (keys, values)
            x = x + y
            x = x + block.mlp(block.mlp_norm(x))
        state.num_tokens += input_ids.numel()
        return self._logits(x)[0]

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
            self._check_state(s, f"states[{b}]")
        x = self.embed(token_ids[:, None])
        for i, block in enumerate(self.blocks):
            h = block.mixer_norm(x)
            if block.kind == "gla":
                batch = torch.stack([s.tensors[i][0] for s in states])
                y, batch = block.mixer.decode(h, batch)
                for s, new in zip(states, batch, strict=True):
                    s.tensors[i][0].copy_(new)
            else:
                y, keys, values = block.mixer.decode(h, [s.tensors[i][0] for s in states],
                                                     [s.tensors[i][1] for s in states])
                for s, k, v in zip(states, keys, values, strict=True):
                    s.tensors[i] = (k, v)
            x = x + y
            x = x + block.mlp(block.mlp_norm(x))
        for s in states:
            s.num_tokens += 1
        return self._logits(x)[:, 0]

    def _check_state(self, state: SequenceState, name: str) -> None:
        kinds = [LAYER_KINDS[c] for c in self.cfg.layers]
        if not isinstance(state, SequenceState) or state.kinds != kinds:
            got = state.kinds if isinstance(state, SequenceState) else type(state).__name__
            raise ValueError(f"{name} must be a SequenceState with layer kinds {kinds} "
                             f"(use model.new_state()), got {got}")
