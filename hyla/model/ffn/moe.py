"""``E``: a mixture-of-experts feed-forward (routed SwiGLU experts, optional shared expert).

Two routers, the two the hybrid families ship:

- ``softmax``: top-k of the softmax over experts, optionally renormalised over the k
  (``norm_topk``); Qwen3-Next / Qwen3.5, with a sigmoid-gated shared expert;
- ``sigmoid``: sigmoid scores; the choice adds a score-correction bias (``score_bias``, a
  buffer trained by load balancing, not by gradients) and may be group-limited (the
  ``topk_group`` best of ``n_group`` groups, a group scored by its two best experts); the
  weights are the unbiased scores of the chosen experts, optionally renormalised, times
  ``scaling`` (DeepSeek-V3's router: Kimi Linear, Ring-2.5, MiMo-V2-Flash).

Only the experts tokens were routed to are computed: the (token, choice) pairs are sorted by
expert and each expert runs once on its contiguous rows (``torch._grouped_mm`` does all of
them in one call on CUDA). No ``[tokens, experts, ...]`` tensor is ever built.

Load balancing (hyla's own MoE presets): DeepSeek-V3's auxiliary-loss-free bias. In training
mode each layer adds its tokens per expert to ``expert_counts`` ([E] long, a plain attribute:
no graph, not in the state dict); after each optimizer step
:func:`hyla.train.routing.balance_experts` sums them over the ranks and moves ``score_bias``
by ``balance_rate * sign(mean load - load)``. ``record_routes`` keeps the last forward's
expert ids (``last_routes``), which the routing-stability metric compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.ffn.base import FFN, register_ffn
from hyla.model.layers import SwiGLU

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEOptions:
    """``cfg.ffn_options["moe"]``: the experts and their router (transformers' names in
    brackets)."""

    num_experts: int                 # routed experts (num_experts, n_routed_experts)
    top_k: int                       # experts a token (num_experts_per_tok)
    expert_dim: int                  # SwiGLU width of one expert (moe_intermediate_size)
    router: str = "softmax"          # "softmax" or "sigmoid" (see the module docstring)
    norm_topk: bool = False          # renormalise the k weights to sum to 1 (norm_topk_prob)
    scaling: float = 1.0             # routed weights times this (routed_scaling_factor)
    n_group: int = 1                 # expert groups for group-limited top-k (n_group)
    topk_group: int = 1              # groups a token may use (topk_group)
    score_bias: bool = False         # e_score_correction_bias added for the choice only
    shared_dim: int = 0              # SwiGLU width of the shared expert(s); 0: none
    shared_gate: bool = False        # shared output times sigmoid(shared_gate(x)) (Qwen3-Next)
    grouped_mm: str = "auto"         # "auto" (on CUDA), "always", "never": torch._grouped_mm
    balance_rate: float = 0.0        # score_bias step a training step (hyla.train.routing)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_dim", "n_group", "topk_group"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts="
                             f"{self.num_experts} and be >= topk_group={self.topk_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("group-limited routing scores a group by its two best experts: "
                             "num_experts / n_group must be >= 2")
        if self.n_group > 1 and self.router != "sigmoid":
            raise ValueError("group-limited top-k (n_group > 1) needs router='sigmoid'")
        if self.score_bias and self.router != "sigmoid":
            raise ValueError("score_bias needs router='sigmoid'")
        if self.shared_dim < 0 or (self.shared_gate and not self.shared_dim):
            raise ValueError(f"shared_dim must be >= 0 (and > 0 with shared_gate), "
                             f"got {self.shared_dim}")
        if self.grouped_mm not in ("auto", "always", "never"):
            raise ValueError(f"grouped_mm must be 'auto', 'always' or 'never', "
                             f"got {self.grouped_mm!r}")
        if self.balance_rate < 0 or (self.balance_rate and not self.score_bias):
            raise ValueError(f"balance_rate must be >= 0 (and 0 without score_bias: it moves "
                             f"the bias), got {self.balance_rate}")


@register_ffn("E")
class MoEFFN(FFN):
    """Routed SwiGLU experts (``gate_up [E, 2 * expert_dim, d]``, ``down [E, d, expert_dim]``:
    transformers 5's fused layout), a ``router`` [E, d], maybe ``score_bias`` [E] and a shared
    expert (``shared``, ``shared_gate``).

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> cfg = dataclasses.replace(preset("debug"), ffn_layers="SEES", ffn_options={"moe": {
        ...     "num_experts": 4, "top_k": 2, "expert_dim": 32, "shared_dim": 16}})
        >>> moe = MoEFFN(cfg)
        >>> moe(torch.randn(2, 3, 64)).shape, MoEFFN.active_parameters(cfg) < \\
        ...     MoEFFN.parameters_count(cfg)
        (torch.Size([2, 3, 64]), True)
    """

    kind = "moe"
    options_class = MoEOptions

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        o, d = self.opts, cfg.d_model
        self.router = nn.Linear(d, o.num_experts, bias=False)
        if o.score_bias:
            self.register_buffer("score_bias", torch.zeros(o.num_experts))
        std = cfg.initializer_range
        self.gate_up = nn.Parameter(torch.randn(o.num_experts, 2 * o.expert_dim, d) * std)
        self.down = nn.Parameter(torch.randn(o.num_experts, d, o.expert_dim) * std)
        if o.shared_dim:
            self.shared = SwiGLU(d, o.shared_dim)
            if o.shared_gate:
                self.shared_gate = nn.Linear(d, 1, bias=False)
        # Plain attributes, not buffers: never saved, moved or left uninitialised by to_empty.
        self.expert_counts: torch.Tensor | None = None    # [E] long, tokens routed (training)
        self.record_routes = False
        self.last_routes: torch.Tensor | None = None      # [N, k] long, when record_routes

    @classmethod
    def parameters_count(cls, cfg) -> int:
        o = cls.options(cfg)
        return cfg.d_model * (o.num_experts * (1 + 3 * o.expert_dim) + 3 * o.shared_dim
                              + int(o.shared_gate))

    @classmethod
    def active_parameters(cls, cfg) -> int:
        o = cls.options(cfg)
        return cfg.d_model * (o.num_experts + 3 * o.top_k * o.expert_dim + 3 * o.shared_dim
                              + int(o.shared_gate))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, d] -> (weights [N, k] float32, expert ids [N, k] long)."""
        o = self.opts
        logits = F.linear(h.float(), self.router.weight.float())
        if o.router == "softmax":
            weights, ids = torch.topk(logits.softmax(-1), o.top_k, dim=-1)
            if o.norm_topk:
                weights = weights / weights.sum(-1, keepdim=True)
            return weights * o.scaling, ids
        scores = logits.sigmoid()
        choice = scores + self.score_bias.float() if o.score_bias else scores
        if o.n_group > 1 and o.topk_group < o.n_group:
            groups = choice.view(-1, o.n_group, o.num_experts // o.n_group)
            best = groups.topk(2, dim=-1)[0].sum(-1)                          # [N, n_group]
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
                1, best.topk(o.topk_group, dim=-1)[1], True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = torch.topk(choice, o.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if o.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * o.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        if h.shape[0] > 1 and not self.training:
            from hyla.model.quantize import one_row_active

            if one_row_active():    # a verify's rows, each as a plain step computes it alone
                return torch.cat([self._tokens(h[i:i + 1]) for i in range(h.shape[0])]
                                 ).view(shape)   # (rows grouped by expert round otherwise)
        return self._tokens(h).view(shape)

    def _tokens(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, d] -> [N, d]."""
        weights, ids = self.route(h)
        if self.record_routes:
            self.last_routes = ids.detach()
        # the routing decisions, whichever experts then run them (fomoe skips some); a forward
        # recomputed in backward (activation checkpointing) must not count twice
        if self.training and torch._C._current_graph_task_id() == -1:
            counts = torch.bincount(ids.reshape(-1), minlength=self.opts.num_experts)
            self.expert_counts = (counts if self.expert_counts is None
                                  else self.expert_counts + counts)
        out = self.combine_experts(h, ids, weights)
        if self.opts.shared_dim:
            shared = self.shared(h)
            if self.opts.shared_gate:
                shared = torch.sigmoid(self.shared_gate(h)) * shared
            out = out + shared
        return out

    def combine_experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """h [N, d], ids and weights [N, k] -> [N, d]: the sum over each token's k experts of
        weight * expert(h), grouped by expert (fomoe overrides it to run only held experts)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k                                 # the token of each sorted row
        xs = h[token]                                      # [N * k, d], rows grouped by expert
        counts = torch.bincount(flat, minlength=self.opts.num_experts)
        if self._use_grouped_mm(h):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gu = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offs)
            g, u = gu.chunk(2, dim=-1)
            ys = torch._grouped_mm(F.silu(g) * u, self.down.transpose(1, 2), offs=offs)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    g, u = F.linear(xs[start:start + n], self.gate_up[e]).chunk(2, dim=-1)
                    parts.append(F.linear(F.silu(g) * u, self.down[e]))
                    start += n
            ys = torch.cat(parts) if parts else xs.new_zeros(0, h.shape[-1])
        ys = ys.float() * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, token, ys.to(h.dtype))

    def _use_grouped_mm(self, h: torch.Tensor) -> bool:
        mode = self.opts.grouped_mm
        if mode == "never" or not hasattr(torch, "_grouped_mm"):
            return False
        # its kernels need 16-byte aligned rows
        aligned = all(n * h.element_size() % 16 == 0
                      for n in (h.shape[-1], self.opts.expert_dim))
        return aligned and (mode == "always" or h.is_cuda)
