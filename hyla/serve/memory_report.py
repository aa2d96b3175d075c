"""Where a server's resident memory goes: the breakdown ``hyla serve`` logs once it is ready.

The resident set (``/proc/self/statm``) split into what hyla can count: the model's tensors
(parameters, buffers and the tensors its layers keep beside them, such as a quantised
layer's dense or int8 copies; each storage once), the engine's fixed state slots and
snapshots, and the KV blocks in use (the KV reservation is mapped lazily on a CPU: only
written blocks are resident). The rest is the interpreter, torch and the other libraries,
the tokenizer and the allocator's caches; the resident set before the model was loaded says
how much of it came with the imports.

Example:
    >>> from hyla.model import HylaLM, preset
    >>> counted = tensor_bytes(HylaLM(preset("debug")))
    >>> counted["float"] > 0 and counted["quantised"] == 0
    True
"""

from __future__ import annotations

import os

import torch
from torch import nn

MB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _copies(module: nn.Module):
    """The objects beside tensors that a layer keeps as plain attributes (a quantised
    layer's fbgemm copies: :class:`~hyla.model.vnni_int8.VnniInt8Matmul`)."""
    for m in module.modules():
        for value in vars(m).values():
            if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor)):
                yield value


def _tensors(module: nn.Module):
    for m in module.modules():
        yield from m._parameters.values()
        yield from m._buffers.values()
        # copies a layer keeps as plain attributes
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))
    for copy in _copies(module):
        yield from (v for v in vars(copy).values() if isinstance(v, torch.Tensor))


def tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's tensors, each storage once: ``{"float": ..., "quantised": ...}``
    (integer tensors count as quantised: codes, packed weights, int8 copies, and fbgemm's
    packed copies, which are not torch tensors: each says its ``packed_bytes``)."""
    seen, out = set(), {"float": 0, "quantised": 0}
    packed = {id(c): c.packed_bytes for c in _copies(model) if hasattr(c, "packed_bytes")}
    out["quantised"] += sum(packed.values())
    for t in _tensors(model):
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device.type, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out["float" if t.is_floating_point() else "quantised"] += storage.nbytes()
    return out


GROUPS = ("full attention", "window", "recurrent")


def group_bytes(engine) -> dict[str, dict[str, int]]:
    """Per memory group (:attr:`~hyla.model.mixers.StateSpec.group`): ``{"in_use",
    "reserved", "unit"}`` bytes. Full-attention layers page their KV in blocks (``unit``:
    a block's bytes); window layers keep a ring and recurrent layers a fixed state in each
    slot (``unit``: a slot's bytes), held while a request runs. Admission counts each:
    blocks for the first, slots for the others.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.serve.engine import Engine, EngineConfig
        >>> eng = Engine(HylaLM(preset("debug")), None, EngineConfig(max_model_len=64))
        >>> g = group_bytes(eng)
        >>> g["recurrent"]["unit"], g["window"]["reserved"], g["full attention"]["in_use"]
        (6144, 0, 0)
    """
    runner, sched = engine.runner, engine.scheduler
    slots, used = sched.pool.num_slots, sched.pool.num_used
    out = {}
    for group in ("window", "recurrent"):
        one = sum(spec.fixed_bytes(runner.dtype) for spec in runner.specs if spec.group == group)
        out[group] = {"in_use": used * one, "reserved": slots * one, "unit": one}
    blocks, total = sched.blocks, sched.config.num_kv_blocks or 0
    block = (engine.kv_cache_bytes or 0) // total if total else 0
    out["full attention"] = {"in_use": block * (blocks.num_used if blocks is not None else 0),
                             "reserved": engine.kv_cache_bytes or 0, "unit": block}
    return {g: out[g] for g in GROUPS}


def mtp_state_bytes(engine) -> int:
    """``--speculative mtp``'s bytes for the running requests: the target's hidden states
    it drafts from (:class:`~hyla.serve.hidden_log.HiddenLog`) and each request's MTP
    layer keys and values (:class:`~hyla.model.mtp.MTPState`); 0 without it."""
    log, speculator = engine.runner.hidden_log, getattr(engine, "speculator", None)
    return (log.nbytes() if log is not None else 0) + (
        speculator.state_bytes() if speculator is not None else 0)


def breakdown(engine, rss_before_model: int = 0) -> dict[str, int]:
    """Bytes by part for a serving :class:`~hyla.serve.engine.Engine`: ``resident``,
    ``weights_float``, ``weights_quantised``, ``state_slots`` (fixed state and snapshots),
    ``kv_in_use`` (blocks held by requests), ``kv_reserved``, ``draft_model`` (speculative
    decoding's draft weights), ``draft_reserved`` (its states' buffers: KV blocks mapped as
    they fill, like ``kv_reserved``), ``mtp_state`` (``--speculative mtp``: the target's
    hidden states it drafts from and its MTP layers' keys and values, each running
    request's), ``rest`` (resident minus what
    is counted) and ``before_model`` (the resident set before loading, 0 if unknown)."""
    runner = engine.runner
    weights = tensor_bytes(engine.model)
    fixed = sum(group[e.name].numel() * group[e.name].element_size()
                for spec, layer, snaps in zip(runner.specs, runner.buffers, runner.snapshots,
                                              strict=True)
                for group in (layer, snaps) for e in spec.fixed)
    blocks = engine.scheduler.blocks
    kv_reserved = engine.kv_cache_bytes or 0
    total_blocks = engine.scheduler.config.num_kv_blocks or 0
    kv_in_use = (kv_reserved * blocks.num_used // total_blocks
                 if blocks is not None and total_blocks else 0)
    draft = getattr(engine, "draft_model", None)
    draft_bytes = sum(tensor_bytes(draft).values()) if draft is not None else 0
    slots = getattr(engine, "draft_slots", None)
    draft_reserved = sum(t.numel() * t.element_size() for layer in slots.runner.buffers
                         for t in layer.values()) if slots is not None else 0
    mtp = mtp_state_bytes(engine)
    resident = rss_bytes()
    counted = weights["float"] + weights["quantised"] + fixed + kv_in_use + draft_bytes + mtp
    return {"resident": resident, "weights_float": weights["float"],
            "weights_quantised": weights["quantised"], "state_slots": fixed,
            "kv_in_use": kv_in_use, "kv_reserved": kv_reserved, "draft_model": draft_bytes,
            "draft_reserved": draft_reserved, "mtp_state": mtp,
            "rest": max(0, resident - counted), "before_model": rss_before_model}


def describe(parts: dict[str, int]) -> str:
    """One log line of :func:`breakdown`'s parts, in MB."""
    mb = {k: v / MB for k, v in parts.items()}
    weights = mb["weights_float"] + mb["weights_quantised"]
    line = (f"memory: {mb['resident']:.0f} MB resident = weights {weights:.0f} MB "
            f"({mb['weights_quantised']:.0f} quantised, {mb['weights_float']:.0f} float) + state "
            f"slots {mb['state_slots']:.1f} MB + KV in use {mb['kv_in_use']:.1f} MB (of "
            f"{mb['kv_reserved']:.0f} MB reserved, mapped as used)"
            + (f" + draft model {mb['draft_model']:.0f} MB (its states "
               f"{mb.get('draft_reserved', 0):.0f} MB reserved, mapped as used)"
               if parts.get("draft_model") else "")
            + (f" + MTP state {mb['mtp_state']:.1f} MB" if parts.get("mtp_state") else "")
            + " + the rest "
            f"{mb['rest']:.0f} MB (interpreter, libraries, tokenizer, allocator)")
    if parts["before_model"]:
        line += f"; {mb['before_model']:.0f} MB were resident before the model was loaded"
    return line


def describe_groups(groups: dict[str, dict[str, int]]) -> str:
    """One log line of :func:`group_bytes`, in MB (the groups the model has)."""
    unit = {"full attention": "a block", "window": "a slot", "recurrent": "a slot"}
    parts = [f"{g} {v['in_use'] / MB:.1f} of {v['reserved'] / MB:.1f} MB "
             f"({unit[g]} {v['unit'] / 1024:.1f} KB)" for g, v in groups.items() if v["unit"]]
    return "state by group: " + ("; ".join(parts) or "none (no per-sequence state)")
