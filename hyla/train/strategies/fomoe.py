"""FoMoE's partial expert replication: each expert on ``R`` of ``W`` workers, token skipping.

``--strategy fomoe`` is DiLoCo's loop (:mod:`hyla.train.strategies.diloco`) in which a worker
holds only some experts of every MoE layer:

- **placement** (:func:`expert_placement`): the ``E x R`` (expert, replica) slots are dealt
  round-robin to the workers, so expert ``e`` lives on the ``R`` consecutive ranks
  ``e*R, e*R + 1, ... (mod W)`` and every worker holds exactly ``E*R/W`` experts (which must
  be a whole number). The same placement serves every MoE layer; it is deterministic, so
  every rank computes it without talking, and it is recorded in checkpoints and ``run.json``.
- **allocation** (:func:`hold_experts`): each MoE layer keeps ``gate_up`` / ``down`` as only
  the held experts' rows, ``[E_held, ...]``, plus an index map ``local_index [E]`` (``-1``:
  held elsewhere). Parameter and optimizer bytes of the experts fall to ``R/W``. The router
  and the shared expert stay whole: the router still scores all ``E`` experts.
- **token skipping** (``--token-skipping``, on by default): a (token, expert) pair whose
  expert is held elsewhere is dropped, and the token's remaining routed weights are scaled
  up to the routed mass its top-k had (``sum of the k weights``). The token itself stays in
  the loss: it still trains the shared parameters (mixers, router, shared expert) and the
  experts this worker holds. FoMoE's abstract says workers "skip tokens routed elsewhere"; we
  read it as skipping the *expert computation* of those tokens (which is what makes a step
  cheaper: a worker computes about ``R/W`` of the routed pairs) rather than dropping whole
  tokens from the loss, which at ``R = 1, W = 4, top-2`` would discard ~94% of the tokens'
  signal to the shared parameters. A token none of whose experts is held gets only the
  shared expert's output.
- ``--no-token-skipping``: the top-k is chosen among the held experts only (the router's
  scores over all experts, the others masked), so every token still runs ``k`` experts: the
  same expert compute as DiLoCo, the baseline token skipping is measured against.

With ``R = W`` every worker holds every expert and the layer computes exactly what
:class:`~hyla.model.ffn.moe.MoEFFN` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.ffn.moe import MoEFFN


def expert_placement(num_experts: int, world: int, replicas: int) -> list[list[int]]:
    """The ranks holding each expert: ``[E]`` lists of ``R`` ranks (see the module doc).

    Example:
        >>> expert_placement(4, 2, 1)
        [[0], [1], [0], [1]]
        >>> expert_placement(4, 4, 2)
        [[0, 1], [2, 3], [0, 1], [2, 3]]
        >>> expert_placement(6, 4, 1)
        Traceback (most recent call last):
        ...
        ValueError: --expert-replicas 1 with 6 experts on 4 workers: ...
    """
    if not 1 <= replicas <= world:
        raise ValueError(f"--expert-replicas must be in 1..{world} (the world size), got "
                         f"{replicas}")
    if num_experts * replicas % world:
        ok = [r for r in range(1, world + 1) if num_experts * r % world == 0]
        raise ValueError(f"--expert-replicas {replicas} with {num_experts} experts on {world} "
                         f"workers: {num_experts} x {replicas} expert copies do not split "
                         f"evenly over {world} workers; use --expert-replicas in {ok}")
    return [sorted((e * replicas + j) % world for j in range(replicas))
            for e in range(num_experts)]


def held_by(placement: list[list[int]], rank: int) -> list[int]:
    """The experts ``rank`` holds, ascending.

    Example:
        >>> held_by(expert_placement(4, 2, 1), 1)
        [1, 3]
    """
    return [e for e, ranks in enumerate(placement) if rank in ranks]


def moe_layers(model: nn.Module) -> list[MoEFFN]:
    """Every MoE feed-forward of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFFN)]


class HeldExperts(MoEFFN):
    """An :class:`~hyla.model.ffn.moe.MoEFFN` holding only some experts (made by
    :func:`hold_experts`): ``gate_up [E_held, 2 * expert_dim, d]``, ``down [E_held, d,
    expert_dim]``, ``held`` (global ids) and ``local_index [E]`` (a global id's row, or -1).

    Example:
        >>> import dataclasses
        >>> from hyla.model.config import preset
        >>> cfg = dataclasses.replace(preset("debug"), ffn_layers="EEEE", ffn_options={"moe": {
        ...     "num_experts": 4, "top_k": 2, "expert_dim": 8}})
        >>> moe = MoEFFN(cfg)
        >>> layer = hold_experts_in(moe, [1, 3], token_skipping=True)
        >>> layer.gate_up.shape[0], layer(torch.randn(5, 64)).shape
        (2, torch.Size([5, 64]))
    """

    held: list[int]
    token_skipping: bool

    @property
    def holds_all(self) -> bool:
        return len(self.held) == self.opts.num_experts

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.token_skipping or self.holds_all:
            return super().route(h)
        # No skipping: the top-k among the held experts (others masked), k experts a token.
        o = self.opts
        logits = F.linear(h.float(), self.router.weight.float())
        scores = logits.softmax(-1) if o.router == "softmax" else logits.sigmoid()
        choice = scores + self.score_bias.float() if o.score_bias else scores
        choice = choice.masked_fill(self.local_index < 0, float("-inf"))
        ids = torch.topk(choice, o.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if o.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * o.scaling, ids

    def combine_experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        if self.holds_all:
            return super().combine_experts(h, ids, weights)
        k = ids.shape[1]
        local = self.local_index[ids]                          # [N, k]; -1: held elsewhere
        kept = weights * (local >= 0)
        # the token keeps its routed mass on the experts it still reaches (module doc)
        weights = kept * (weights.sum(-1, keepdim=True)
                          / kept.sum(-1, keepdim=True).clamp_min(1e-20))
        pair = (local.reshape(-1) >= 0).nonzero().squeeze(1)    # the (token, choice) pairs kept
        flat = local.reshape(-1)[pair]
        order = torch.argsort(flat, stable=True)
        rows = pair[order]
        token = rows // k
        xs = h[token]
        parts, start = [], 0
        for e, n in enumerate(torch.bincount(flat, minlength=len(self.held)).tolist()):
            if n:
                g, u = F.linear(xs[start:start + n], self.gate_up[e]).chunk(2, dim=-1)
                parts.append(F.linear(F.silu(g) * u, self.down[e]))
                start += n
        ys = torch.cat(parts) if parts else xs.new_zeros(0, h.shape[-1])
        ys = ys.float() * weights.reshape(-1)[rows, None]
        return torch.zeros_like(h).index_add_(0, token, ys.to(h.dtype))


@torch.no_grad()
def hold_experts_in(layer: MoEFFN, held: list[int], *, token_skipping: bool) -> HeldExperts:
    """Make ``layer`` (in place) a :class:`HeldExperts` keeping only experts ``held``."""
    o = layer.opts
    if not token_skipping and len(held) < o.top_k:
        raise ValueError(f"--no-token-skipping routes each token to top_k={o.top_k} held "
                         f"experts, but a worker holds {len(held)}: raise --expert-replicas "
                         f"or keep --token-skipping")
    index = torch.full((o.num_experts,), -1, dtype=torch.long, device=layer.gate_up.device)
    index[torch.tensor(held, dtype=torch.long)] = torch.arange(len(held), device=index.device)
    pick = index.new_tensor(held)
    # The same keys (gate_up, down) with fewer rows: the full tensors are freed here.
    layer.gate_up = nn.Parameter(layer.gate_up.data[pick].clone())
    layer.down = nn.Parameter(layer.down.data[pick].clone())
    layer.register_buffer("local_index", index, persistent=False)
    layer.__class__ = HeldExperts
    layer.held, layer.token_skipping = list(held), token_skipping
    return layer


def require_moe(model: nn.Module) -> list[MoEFFN]:
    """``model``'s MoE layers; ValueError when it has none (``--strategy fomoe`` needs them).

    Example:
        >>> require_moe(nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        ValueError: --strategy fomoe places experts, but the model has no MoE layer ...
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("--strategy fomoe places experts, but the model has no MoE layer "
                         "(cfg.ffn_layers has no 'E'): use a MoE preset (e.g. debug-moe, "
                         "small-moe) or --strategy diloco")
    return layers


def hold_experts(model: nn.Module, placement: list[list[int]], rank: int, *,
                 token_skipping: bool = True) -> list[HeldExperts]:
    """Keep in every MoE layer of ``model`` only the experts ``rank`` holds (in place);
    returns the layers. ValueError when the model has no MoE layer."""
    layers = require_moe(model)
    held = held_by(placement, rank)
    return [hold_experts_in(m, held, token_skipping=token_skipping) for m in layers]


def full_param_bytes(model: nn.Module) -> int:
    """The whole model's parameter bytes, every expert counted (a worker's own are fewer).

    Example:
        >>> full_param_bytes(torch.nn.Linear(4, 2, bias=False))
        32
    """
    total, seen = 0, set()
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in seen:    # a tied head is one tensor
                continue
            seen.add(id(p))
            n = p.numel() * p.element_size()
            if isinstance(m, HeldExperts) and name in ("gate_up", "down"):
                n = n // len(m.held) * m.opts.num_experts
            total += n
    return total
