"""``--strategy fsdp`` (the default at W > 1): FSDP2 shards of one model over all ranks.

Each rank builds the same model from the same seed (rank 0's copy is broadcast to make
sure), then:

- shards it with FSDP2: ``fully_shard`` on every block, then on the whole model (embedding,
  final norm, head), over a one-dimensional :class:`~torch.distributed.device_mesh.DeviceMesh`
  (gloo on CPU, nccl on CUDA). Parameters, gradients and optimizer state are ``DTensor`` row
  shards: each rank holds about 1/W of each. FSDP all-gathers a block's parameters for its
  forward and backward and reduce-scatters (averages) its gradients;
- updates the hidden matrices with :class:`~hyla.train.optim.sharded_muon.ShardedMuon` (whole
  matrices at owner ranks, two all-to-alls) and the rest with AdamW on the shards;
- saves checkpoints with ``torch.distributed.checkpoint`` (see
  :mod:`hyla.train.checkpointing.dcp`), every rank its shards, plus a consolidated model.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hyla.ops.hardware import fast_low_precision_matmul
from hyla.train.config import TrainConfig
from hyla.train.optim.comm import CommCounter, count_fsdp_traffic
from hyla.train.optim.param_groups import split_params
from hyla.train.optim.sharded_muon import ShardedMuon
from hyla.train.process_group import broadcast_parameters, reshard
from hyla.train.strategies.base import Strategy


class Fsdp(Strategy):
    """FSDP2 shards; the optimizers on the shards; validation leaves the shards in place."""

    name = "fsdp"

    def prepare(self, model, device, counter):
        broadcast_parameters(model)
        self.mesh = device_mesh(self.world, device)
        shard_model(model, self.cfg, self.mesh, counter)
        return build_optimizers(model, self.cfg, self.mesh)

    def after_validation(self, model) -> None:
        reshard(model)


def device_mesh(world: int, device: torch.device | str = "cpu") -> DeviceMesh:
    """The one-dimensional ``("dp",)`` mesh of all ranks on ``device``'s type."""
    return init_device_mesh(torch.device(device).type, (world,), mesh_dim_names=("dp",))


def mixed_precision(cfg: TrainConfig, device: torch.device | str) -> MixedPrecisionPolicy:
    """bf16 parameters for compute and fp32 gradient reduction with ``--precision bf16`` where
    bf16 matmuls are fast; fp32 throughout otherwise (emulated bf16 costs ~100x on CPUs
    without AMX/AVX512-BF16).

    Example:
        >>> mixed_precision(TrainConfig(), "cpu").param_dtype is None
        True
    """
    if cfg.precision == "bf16" and fast_low_precision_matmul(torch.bfloat16, device):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: torch.nn.Module, cfg: TrainConfig, mesh: DeviceMesh,
                counter: CommCounter | None = None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each of ``model.blocks``, then ``model`` (in place; returned).

    A block is the unit FSDP gathers and frees, so at most about one block's full parameters
    live at once besides the shards. Activation checkpointing (the model's own, per block)
    recomputes inside FSDP's gathered block. ``counter`` counts FSDP's all-gathers and
    reduce-scatters under ``"fsdp"``.
    """
    device = next(model.parameters()).device
    policy = mixed_precision(cfg, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if counter is not None:
        count_fsdp_traffic(model, counter)
    return model


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig,
                     mesh: DeviceMesh) -> list[torch.optim.Optimizer]:
    """The sharded counterpart of :func:`~hyla.train.optim.run_optimizers` (same order and
    hyperparameters): ShardedMuon + AdamW, or AdamW alone, on the FSDP shards."""
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)]
    device = next(model.parameters()).device
    ns_dtype = (torch.bfloat16 if fast_low_precision_matmul(torch.bfloat16, device)
                else torch.float32)
    muon_params, adamw_params = split_params(model)   # 3-D MoE experts go to AdamW
    muon = ShardedMuon([p for _, p in muon_params], strategy=cfg.muon_strategy,
                       group=mesh.get_group(), lr=cfg.muon_lr, momentum=0.95,
                       weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
    decay = [p for _, p in adamw_params if p.ndim >= 2]
    no_decay = [p for _, p in adamw_params if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(0.9, 0.95))
    return [muon, adamw]

