"""Activations of one training micro-batch, traced: what autograd saves for backward.

:func:`activation_bytes` runs the model's forward and loss once with fake tensors (shapes and
dtypes, no memory, no arithmetic) under ``saved_tensors_hooks`` and sums the distinct
storages still saved when the loss is formed, parameters excluded. Only one block of each
distinct kind is traced (:func:`distinct_blocks`), so a 1T mixture-of-experts config takes
seconds. The tests check the count against a real CPU forward's saved tensors (equal) and a
real training step's peak RSS.

Example:
    >>> from hyla.model import preset
    >>> a = activation_bytes(preset("debug"), 1, 64)
    >>> a["saved"] > 0, a["logits_grad"] == 64 * 256 * 4
    (True, True)
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hyla.model.config import HylaConfig

PRECISIONS = ("fp32", "bf16")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class _ScalarsAsZero(TorchDispatchMode):
    """Fake tensors hold no values: answer value reads (``.item()``, ``bool(t)``) with 0, so
    input checks such as ``(g > 0).any()`` pass; shapes never depend on them in training.
    A mixture-of-experts layer's ``bincount`` of expert ids reads as an even spread (its
    activations depend only on the sum, ``tokens x top_k`` rows). Also notes which tensors
    are casts of parameters (autocast's bf16 weight copies)."""

    def __init__(self, param_keys: set[int]):
        super().__init__()
        self.param_keys, self.casts = param_keys, set()
        self.counts, self.fills = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return self.counts.get(_key(args[0]), False if args[0].dtype == torch.bool else 0)
        if func is torch.ops.aten.bincount.default:
            bins = max(kwargs.get("minlength", args[2] if len(args) > 2 else 0), 1)
            out = args[0].new_empty(bins)
            self.counts[_key(out)] = -(-args[0].numel() // bins)
            return out
        if func is torch.ops.aten.repeat_interleave.Tensor and \
                kwargs.get("output_size") is None and _key(args[0]) in self.fills:
            # repeats made by torch.full (equal sequence lengths): the size is known
            kwargs = {**kwargs, "output_size": self.fills[_key(args[0])] * args[0].numel()}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.full.default:
            self.fills[_key(out)] = int(args[1])
        if func is torch.ops.aten._to_copy.default and _key(args[0]) in self.param_keys:
            self.casts.add(_key(out))
        return out


class _Saved:
    """A tensor autograd saved, with where it was saved (a block index or "head")."""

    __slots__ = ("t", "segment", "key", "nbytes", "__weakref__")

    def __init__(self, t: torch.Tensor, segment):
        self.t, self.segment = t, segment
        self.key, self.nbytes = _key(t), t.untyped_storage().nbytes()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def activation_bytes(cfg: HylaConfig, batch_size: int, seq_len: int,
                     precision: str = "fp32") -> dict:
    """Bytes of activations for one training micro-batch ``[batch_size, seq_len]``.

    Traces the forward and the loss with fake tensors (``precision="bf16"``: under CPU
    autocast, as ``hyla train --precision bf16``) and sums the distinct storages autograd
    saves for backward, parameters excluded. Returns ``blocks`` (per block), ``block_inputs``
    (per block, what checkpointing keeps), ``head`` (embedding ids, final norm, head, loss),
    ``weight_copies`` (autocast's bf16 casts of parameters saved for backward),
    ``logits_grad``, ``saved`` (all saved), ``total`` (``saved + logits_grad``) and
    ``checkpointed`` (the same with per-block activation checkpointing).

    Example:
        >>> from hyla.model import preset
        >>> a = activation_bytes(preset("debug"), 1, 64)
        >>> a["logits_grad"] == 64 * 256 * 4, a["checkpointed"] < a["total"]
        (True, True)
    """
    _positive("batch_size", batch_size)
    _positive("seq_len", seq_len)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hyla.model.sizing import skip_init

    reps = distinct_blocks(cfg)
    seen: dict[int, tuple[int, object]] = {}       # storage -> (bytes, segment)
    where: dict = {"segment": "head"}
    inputs: dict[int, int] = {}
    with FakeTensorMode():
        with skip_init():
            model = _shell(cfg, sorted(set(reps)))
        param_keys = {_key(p) for p in model.parameters()}
        mode = _ScalarsAsZero(param_keys)

        def enter(i):
            def hook(module, args):
                where["segment"] = i
                if isinstance(i, int):
                    inputs[i] = args[0].untyped_storage().nbytes()
            return hook

        for block in model.blocks:
            block.register_forward_pre_hook(enter(block.layer_idx))
        model.norm.register_forward_pre_hook(enter("head"))

        def pack(t):
            # Hold the tensor through a box autograd keeps; a box that dies with a discarded
            # branch of the graph is not memory backward needs (and its storage's address
            # may be reused), so only boxes alive at the end count.
            box = _Saved(t, where["segment"])
            if _key(t) not in param_keys:
                boxes.append(weakref.ref(box))
            return box

        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        boxes: list = []
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            with autocast:
                logits = model(ids)
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        for ref in boxes:
            box = ref()
            if box is not None and box.key not in seen:
                seen[box.key] = (box.nbytes, box.segment)
        del loss, logits
    by_segment: dict = {}
    copies_by_segment: dict = {}
    for k, (b, seg) in seen.items():
        table = copies_by_segment if k in mode.casts else by_segment
        table[seg] = table.get(seg, 0) + b
    blocks = [by_segment.get(r, 0) for r in reps]
    inputs = [inputs[r] for r in reps]
    head = by_segment.get("head", 0)
    copies = sum(copies_by_segment.get(r, 0) for r in reps) + copies_by_segment.get("head", 0)
    logits_grad = batch_size * seq_len * cfg.vocab_size * 4
    saved = sum(blocks) + head + copies
    # Checkpointing keeps each block's input; the recomputed block's own saved set (its
    # input already counted) lives during that block's backward only, one block at a time.
    recompute = max(b - x for b, x in zip(blocks, inputs, strict=True))
    checkpointed = sum(inputs) + recompute + head + logits_grad
    return {"blocks": blocks, "block_inputs": inputs, "head": head, "weight_copies": copies,
            "logits_grad": logits_grad, "saved": saved, "total": saved + logits_grad,
            "checkpointed": checkpointed}


def distinct_blocks(cfg: HylaConfig) -> list[int]:
    """For each layer, the first layer built the same way (mixer, FFN kind, per-layer
    options): their activations are equal, so only those are traced.

    Example:
        >>> from hyla.model import preset
        >>> distinct_blocks(preset("debug"))
        [0, 0, 0, 3]
    """
    first: dict = {}
    out = []
    for i, letter in enumerate(cfg.layers):
        layer = cfg.layer_config(i)
        key = (letter, cfg.ffn_letter(i), None if layer is cfg else repr(layer))
        out.append(first.setdefault(key, i))
    return out


def _shell(cfg: HylaConfig, layers: list[int]):
    """``HylaLM(cfg)`` holding only blocks ``layers`` (its forward, the one block loop, runs
    them in order): what tracing needs, without building a 1T model's every expert."""
    from torch import nn

    from hyla.model.layers import RMSNorm
    from hyla.model.model import Block, HylaLM

    model = HylaLM.__new__(HylaLM)
    nn.Module.__init__(model)
    model.cfg, model.activation_checkpointing = cfg, False
    model.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    model.blocks = nn.ModuleList(Block(cfg, cfg.layers[i], i) for i in layers)
    for i, block in zip(layers, model.blocks, strict=True):
        block.layer_idx = i
    model.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, zero_centred=cfg.norm_zero_centred)
    model.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    return model
