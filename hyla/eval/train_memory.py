"""Training memory a rank: parameters, gradients, optimizer state and activations, for FSDP
(everything sharded ``1/W``) against replication (every rank the whole model).

Nothing is allocated: parameter shapes come from the model on the meta device, activations
from one forward pass traced with fake tensors (:mod:`hyla.eval.activation_trace`).

What is counted, in bytes a rank (the busiest rank: shards are ``ceil(rows / W)`` rows along
dim 0, padded, as both FSDP2's ``fully_shard`` and :mod:`hyla.train.optim.comm` cut them):

- ``params``: fp32 master weights. replicate: all ``P``; fsdp: the rank's shards.
- ``grads``: fp32. replicate: all ``P`` (averaged by an all-reduce); fsdp: shards.
- ``optimizer``: Muon's momentum (one buffer a 2-D hidden matrix,
  :func:`hyla.model.parameter_kinds.split_params`) sharded by rows in both strategies (DistMuon
  today, DTensor shards under FSDP); AdamW's two moments for the rest: replicated today,
  sharded under FSDP. ``--optimizer adamw``: two moments for everything.
- ``transient`` (fsdp only): what ``fully_shard`` all-gathers around the compute: the root's
  parameters (embedding, final norm, head: the root is not resharded between forward and
  backward) and their fp32 gradients until the final reduce-scatter, plus two blocks' full
  parameters (the one computing and the one prefetched; bf16 under bf16 mixed precision)
  and one block's fp32 gradient before its reduce-scatter (the largest block each time).
- ``activations`` (both): what autograd saves for backward in one micro-batch of
  ``batch_size x seq_len`` tokens, traced, plus the logits' gradient ``[B, T, vocab]`` fp32
  alive with them when backward starts. With activation checkpointing: each block's input,
  one block's saved tensors (recomputed during its backward), the head's. Not counted: the
  temporaries inside one op's backward (e.g. the chunked GLA recomputing a chunk's scores),
  communication buffers, the allocator's slack. Under ``precision="bf16"`` replication
  runs autocast, which keeps a bf16 copy of every matmul weight for backward (counted);
  fsdp gathers bf16 parameters instead (``MixedPrecisionPolicy(param_dtype=bf16)``, as
  ``hyla train`` does where bf16 matmuls are fast) and frees them after each block, so no
  copies.

Example:
    >>> from hyla.model import preset
    >>> r = train_memory_report(preset("debug"), world_size=2, seq_len=32)
    >>> fsdp, rep = r["strategies"]["fsdp"], r["strategies"]["replicate"]
    >>> fsdp["params"] < rep["params"] == 4 * r["params"]
    True
    >>> fsdp["activations"] == rep["activations"] > 0
    True
"""

from __future__ import annotations

import math

from hyla.eval.activation_trace import PRECISIONS, _positive, activation_bytes
from hyla.model.config import HylaConfig, preset

STRATEGIES = ("fsdp", "replicate")
OPTIMIZERS = ("muon", "adamw")
ITEMS = ("params", "grads", "optimizer", "transient", "activations")
__all__ = ["activation_bytes", "parameter_table", "shard_numel", "train_memory_report"]


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements of the busiest rank's shard of a ``shape`` tensor cut into ``world`` pieces
    along dim 0 (``ceil(rows / world)`` rows, padded).

    Example:
        >>> shard_numel((10, 4), 4), shard_numel((7,), 8), shard_numel((10, 4), 1)
        (12, 1, 40)
    """
    _positive("world_size", world)
    rows = -(-shape[0] // world) if shape else 1
    return rows * math.prod(shape[1:])


def parameter_table(cfg: HylaConfig, optimizer: str = "muon") -> list[dict]:
    """One row a parameter of ``HylaLM(cfg)`` (built on the meta device): ``name``,
    ``shape``, ``group`` ("muon" or "adamw", as training splits them) and ``block`` (its
    block index, None for the embedding, final norm and head).

    Example:
        >>> rows = parameter_table(preset("debug"))
        >>> rows[0]["name"], rows[0]["group"], rows[0]["block"]
        ('embed.weight', 'adamw', None)
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    from hyla.model.parameter_kinds import split_params
    from hyla.model.sizing import meta_model

    muon, adamw = split_params(meta_model(cfg))
    rows = []
    for group, params in (("muon", muon), ("adamw", adamw)):
        for name, p in params:
            block = int(name.split(".")[1]) if name.startswith("blocks.") else None
            rows.append({"name": name, "shape": tuple(p.shape),
                         "group": group if optimizer == "muon" else "adamw", "block": block})
    return sorted(rows, key=lambda r: (r["block"] is not None, r["block"] or 0))


def _comm(strategy: str, world: int, root: int, blocks: int, muon_rows_numel: int,
          param_dtype: int, optimizer: str) -> int:
    """Bytes one rank sends a step (one micro-batch): see ``comm_bytes`` in the report."""
    if world == 1:
        return 0
    part = (world - 1) / world
    total = 4 * (root + blocks)
    # Muon: shards to the matrices' owners and updates back, two all-to-alls; owners are
    # balanced, so each rank sends (W - 1) / W of its 1/W share of the matrices, twice
    a2a = 2 * part * muon_rows_numel * 4 if optimizer == "muon" else 0
    if strategy == "fsdp":
        # all-gathers: every block in forward and again in backward, the root once (it is
        # not resharded in between); one reduce-scatter of the fp32 gradients
        return round(part * (2 * blocks + root) * param_dtype + part * total + a2a)
    # replication: a ring all-reduce of the gradients, then (Muon) the all-to-alls and the
    # all-gather of the updated rows (DistMuon's param_sync)
    sync = part * world * muon_rows_numel * 4 if optimizer == "muon" else 0
    return round(2 * part * total + a2a + sync)


def train_memory_report(cfg: HylaConfig | str, *, world_size: int, seq_len: int = 2048,
                        batch_size: int = 1, precision: str = "fp32", optimizer: str = "muon",
                        activation_checkpointing: bool = False, model: str | None = None
                        ) -> dict:
    """Bytes a rank for training ``cfg`` (a config or a preset name) on ``world_size`` ranks,
    ``batch_size x seq_len`` tokens a rank a micro-batch, under ``fsdp`` and ``replicate``.

    ``strategies[s]`` holds ``params``, ``grads``, ``optimizer`` (``optimizer_muon`` +
    ``optimizer_adamw``), ``transient``, ``activations`` and ``total``; the module docstring
    says what each counts. ``comm_bytes``: what a rank sends a step (one micro-batch),
    as ``metrics.jsonl`` counts it: fsdp all-gathers every block twice and the root once,
    reduce-scatters fp32 gradients; replicate all-reduces them (ring: twice ``(W-1)/W`` of
    them); Muon adds two all-to-alls (and, replicated, the all-gather of updated rows).
    ``activation_detail`` is :func:`activation_bytes`'s answer.
    """
    _positive("world_size", world_size)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(cfg, str):
        model = model or cfg
        cfg = preset(cfg)
    rows = parameter_table(cfg, optimizer)
    act = activation_bytes(cfg, batch_size, seq_len, precision)
    activations = act["checkpointed" if activation_checkpointing else "total"]
    param_dtype = 2 if precision == "bf16" else 4  # what FSDP all-gathers for compute

    def total(w: int, group: str | None = None) -> int:
        return sum(shard_numel(r["shape"], w) for r in rows if group in (None, r["group"]))

    full = {i: sum(math.prod(r["shape"]) for r in rows if r["block"] == i)
            for i in [None, *range(cfg.n_layers)]}
    root, block = full.pop(None), max(full.values(), default=0)
    out = {}
    for name in STRATEGIES:
        sharded = name == "fsdp" and world_size > 1     # at W = 1 both are one process
        w = world_size if sharded else 1
        muon = 4 * total(world_size, "muon")             # row-sharded in both
        adamw = 2 * 4 * total(w, "adamw")
        transient = root * (param_dtype + 4) + block * (2 * param_dtype + 4) if sharded else 0
        s = {"params": 4 * total(w), "grads": 4 * total(w),
             "optimizer": muon + adamw, "optimizer_muon": muon, "optimizer_adamw": adamw,
             "transient": transient, "activations": activations}
        if sharded and not activation_checkpointing:
            s["activations"] -= act["weight_copies"]      # see the module docstring
        s["total"] = sum(s[k] for k in ITEMS)
        s["comm_bytes"] = _comm(name, world_size, root, sum(full.values()), muon // 4,
                                param_dtype, optimizer)
        out[name] = s
    n_params = sum(math.prod(r["shape"]) for r in rows)
    return {"model": model, "params": n_params,
            "muon_params": sum(math.prod(r["shape"]) for r in rows if r["group"] == "muon"),
            "world_size": world_size, "seq_len": seq_len, "batch_size": batch_size,
            "precision": precision, "optimizer": optimizer,
            "activation_checkpointing": activation_checkpointing,
            "root_params": root, "largest_block_params": block,
            "strategies": out, "activation_detail": act}
