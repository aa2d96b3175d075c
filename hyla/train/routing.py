"""The routing of a MoE model in training: load balancing and the routing metrics.

**Balancing.** hyla's MoE presets (``debug-moe``, ``small-moe``) balance the experts'
load with DeepSeek-V3's auxiliary-loss-free bias, not a Switch-style auxiliary loss: each
layer's ``score_bias`` [E] (added to the sigmoid scores for the choice only, never to the
weights) moves after every optimizer step by ``balance_rate * sign(mean load - load_e)``,
where ``load_e`` is the number of (token, choice) pairs the step routed to expert ``e``.
No gradient competes with the language-model loss, and the bias is a buffer updated from
integer counts: once the counts are summed over the ranks, every rank applies the same update
(bit for bit), and diloco / fomoe, whose outer step averages parameters only, never have to
sync it. The pure step is :func:`bias_update`; :func:`balance_experts` applies it.

**Metrics** (``metrics.jsonl``, :class:`RoutingMonitor`):

- ``expert_load_entropy``: the entropy of each layer's load over its experts, divided by
  ``log E`` (1: uniform, 0: one expert takes everything), for the step's tokens (all ranks),
  mean over MoE layers; ``expert_load_entropy_layers``, one a layer;
- ``expert_max_violation``: ``(max load - mean load) / mean load``, mean over layers (0:
  uniform; the loss-free balancing paper's MaxVio);
- ``routing_changed``: the fraction of tokens of a fixed probe batch whose top-k expert set
  changed since the last sync, mean over layers (``routing_changed_layers``: one a layer). A
  sync is a call of :meth:`RoutingMonitor.snapshot`: the loop calls it every
  ``cfg.sync_every`` steps (diloco / fomoe's outer period, right after the outer step: steps
  ``H, 2H, ...``), at the run's last step, and once before training, so the field appears at
  those steps. A strategy that syncs on its own schedule sets ``monitor.every = 0`` and calls
  ``snapshot()`` after each sync; its result goes into the next record.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hyla.model.ffn.moe import MoEFFN


def moe_layers(model: nn.Module) -> list[MoEFFN]:
    """Every MoE feed-forward of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFFN)]


def bias_update(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The ``score_bias`` change for loads ``counts`` [..., E] (one row a layer): ``rate``
    where an expert is under the mean load, ``-rate`` over it, 0 at it; float32 [..., E].

    Example:
        >>> (bias_update(torch.tensor([[5, 3, 0, 0], [2, 2, 2, 2]]), 0.5) * 2).tolist()
        [[-1.0, -1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    """
    c = counts.double()
    return (rate * torch.sign(c.mean(-1, keepdim=True) - c)).float()


def load_entropy(counts: torch.Tensor) -> torch.Tensor:
    """Entropy of the load over the experts, normalised to [0, 1]: counts [..., E] ->
    [...] float (1 where no token was routed: nothing is imbalanced).

    Example:
        >>> load_entropy(torch.tensor([[5, 5, 5, 5], [20, 0, 0, 0], [1, 1, 0, 0]])).tolist()
        [1.0, 0.0, 0.5]
    """
    c = counts.double()
    total = c.sum(-1, keepdim=True)
    p = c / total.clamp_min(1)
    h = -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(c.shape[-1])
    return torch.where(total[..., 0] > 0, h, torch.ones_like(h)).clamp(0, 1) + 0.0  # no -0.0


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """``(max load - mean load) / mean load``: counts [..., E] -> [...] float (0: uniform).

    Example:
        >>> max_violation(torch.tensor([3, 1, 0, 0])).item()
        2.0
    """
    c = counts.double()
    mean = c.mean(-1)
    return (c.amax(-1) - mean) / mean.clamp_min(1e-12)


def take_counts(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's tokens per expert since the last call ([E] long, zeros where it saw
    none), resetting them. The layers count in training mode only."""
    out = []
    for m in moe_layers(model):
        c = m.expert_counts
        if c is None:
            c = torch.zeros(m.opts.num_experts, dtype=torch.long, device=m.router.weight.device)
        out.append(c)
        m.expert_counts = None
    return out


def all_reduce_counts(counts: list[torch.Tensor], group=None, counter=None) -> list[torch.Tensor]:
    """The counts summed over the ranks of ``group`` (one all-reduce of every layer's counts;
    ``counts`` itself when torch.distributed is not initialised or has one rank). ``counter``
    (a :class:`~hyla.train.optim.comm.CommCounter`) counts a ring all-reduce's bytes under
    ``"routing"``: ``2 (W - 1) / W`` of the buffer each way."""
    if not counts or not (dist.is_available() and dist.is_initialized()):
        return counts
    world = dist.get_world_size(group)
    if world == 1:
        return counts
    flat = torch.cat(counts)
    dist.all_reduce(flat, group=group)
    if counter is not None:
        n = 2 * (world - 1) * flat.numel() * flat.element_size() // world
        counter.add("routing", sent=n, received=n)
    return list(flat.split([c.numel() for c in counts]))


@torch.no_grad()
def balance_experts(model: nn.Module, counts: list[torch.Tensor]) -> None:
    """Apply :func:`bias_update` to every MoE layer with ``balance_rate > 0`` (its own rate),
    ``counts`` being :func:`take_counts`'s (summed over the ranks first, for one bias
    everywhere)."""
    for m, c in zip(moe_layers(model), counts, strict=True):
        if m.opts.balance_rate:
            m.score_bias.add_(bias_update(c, m.opts.balance_rate).to(m.score_bias))


@torch.no_grad()
def probe_routes(model: nn.Module, ids: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert set of every token of ``ids`` [1, N] (one eval-mode
    forward, no counting): [N, k] long a layer, each row sorted."""
    layers = moe_layers(model)
    was_training = model.training
    model.eval()
    for m in layers:
        m.record_routes = True
    try:
        model(ids, cu_seqlens=cu_seqlens, hidden=True)
    finally:
        for m in layers:
            m.record_routes = False
        model.train(was_training)
    from hyla.train.process_group import (
        reshard,  # a forward alone leaves FSDP2's root gathered
    )

    reshard(model)
    routes = [m.last_routes.sort(-1).values for m in layers]
    for m in layers:
        m.last_routes = None
    return routes


def routes_changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[float]:
    """Per layer, the fraction of tokens whose top-k set differs (sorted rows [N, k]).

    Example:
        >>> a = torch.tensor([[0, 1], [2, 3]])
        >>> routes_changed([a], [a]), routes_changed([a], [torch.tensor([[0, 1], [1, 3]])])
        ([0.0], [0.5])
    """
    return [(b != a).any(-1).double().mean().item() for b, a in zip(before, after, strict=True)]


class RoutingMonitor:
    """Balances ``model``'s experts after each optimizer step and measures its routing.

    Args:
        model: a model with MoE layers (:class:`~hyla.model.ffn.moe.MoEFFN`).
        probe: ``(ids [1, N], cu_seqlens or None)``: the fixed tokens ``routing_changed``
            compares (the same every snapshot).
        every: snapshot every this many steps in :meth:`after_step` (0: never; a strategy
            that syncs on its own calls :meth:`snapshot`).
        reduce: ``counts (list of [E]) -> counts`` summed over the ranks that must share one
            bias (default :func:`all_reduce_counts` over the default group); a strategy may
            put its own (another group, or identity for a rank-local bias).

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug-moe"))
        >>> monitor = RoutingMonitor(model, (torch.randint(0, 256, (1, 32)), None), every=2)
        >>> model(torch.randint(0, 256, (1, 16))).sum().backward()    # counts 16 tokens x 2
        >>> r = monitor.after_step(1)       # the biases move, no snapshot at step 1
        >>> 0 <= r["expert_load_entropy"] <= 1, "routing_changed" in r
        (True, False)
        >>> 0 <= monitor.after_step(2)["routing_changed"] <= 1     # every=2: a snapshot
        True
        >>> monitor.snapshot()["routing_changed"]     # nothing changed since
        0.0
    """

    def __init__(self, model: nn.Module, probe: tuple, *, every: int = 16,
                 reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
                 counter=None):
        self.model, self.every = model, every
        self.reduce = reduce or (lambda c: all_reduce_counts(c, counter=counter))
        device = next(model.parameters()).device
        self.probe = tuple(None if t is None else t.to(device) for t in probe)
        self.routes = probe_routes(model, *self.probe)
        self.pending: dict = {}

    def snapshot(self) -> dict:
        """The routing_changed metrics since the last snapshot; this one becomes the
        reference. Every rank must call it (a forward of the probe)."""
        routes = probe_routes(self.model, *self.probe)
        changed = routes_changed(self.routes, routes)
        self.routes = routes
        self.pending = {"routing_changed": sum(changed) / len(changed),
                        "routing_changed_layers": [round(x, 6) for x in changed]}
        return dict(self.pending)

    def after_step(self, step: int, final: bool = False) -> dict:
        """After optimizer step ``step``: sum the step's counts over the ranks, move the
        biases, and return the metrics (with ``routing_changed`` when this step snapshots,
        every ``every`` steps and at the ``final`` one, or when a strategy did)."""
        counts = self.reduce(take_counts(self.model))
        balance_experts(self.model, counts)
        c = torch.stack([x.cpu() for x in counts]) if counts else torch.zeros(0, 1)
        entropy = load_entropy(c) if counts else torch.zeros(0)
        record = {"expert_load_entropy": entropy.mean().item() if counts else 1.0,
                  "expert_load_entropy_layers": [round(x, 6) for x in entropy.tolist()],
                  "expert_max_violation": max_violation(c).mean().item() if counts else 0.0}
        if final or (self.every and step % self.every == 0):
            self.snapshot()
        record.update(self.pending)
        self.pending = {}
        return record


def routing_monitor(model: nn.Module, tokenizer, cfg, counter=None) -> RoutingMonitor | None:
    """The :class:`RoutingMonitor` of a ``hyla train`` run (None without MoE layers): the
    probe is the first ``cfg.batch_size`` validation blocks, the snapshots every
    ``cfg.sync_every`` steps (16 when the config has none).

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.train.config import TrainConfig
        >>> cfg = TrainConfig(seq_len=16, batch_size=2)
        >>> routing_monitor(HylaLM(preset("debug")), ByteTokenizer(), cfg) is None
        True
        >>> routing_monitor(HylaLM(preset("debug-moe")), ByteTokenizer(), cfg).probe[0].shape
        torch.Size([1, 32])
    """
    if not moe_layers(model):
        return None
    from hyla.data.packing import corpus_blocks
    from hyla.train.batches import next_batch

    blocks = corpus_blocks(cfg.data, tokenizer, cfg.seq_len, split="validation", seed=0)
    ids, _, cu = next_batch(blocks, cfg.batch_size)
    return RoutingMonitor(model, (ids, cu), every=getattr(cfg, "sync_every", 16),
                          counter=counter)
