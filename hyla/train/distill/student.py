"""Build a hybrid student from an all-attention teacher, weights copied where they fit.

The student has the teacher's width, depth, vocabulary, embeddings, MLPs and norms. Its layer
mix is a pattern such as ``"GGGA" * 4``:

Each student mixer takes what fits from the teacher's attention layer at its place
(:meth:`hyla.model.mixers.Mixer.init_from_attention`; the ``A`` and ``G`` mixers document
how), and says whether it is then an exact copy (nothing for stage 1 to learn). With a
window, ``G``, ``D`` and ``K`` are linearised attention (:mod:`hyla.model.mixers.linearised.gla`,
:mod:`hyla.model.mixers.linearised.delta`): the teacher's q/k/v/o, an exact window + sinks and a
GLA or gated-delta-rule branch, calibrated from the teacher's attention. The
student's linear layers get ``expand_k = expand_v = 1``, so each head has the teacher's
head dim.
"""

from __future__ import annotations

import dataclasses

import torch

from hyla.model import HylaConfig, HylaLM
from hyla.model.layers import norm_weight
from hyla.model.mixers import MIXERS, AttentionMixer


def student_config(teacher: HylaConfig, layers: str, kv_heads: int | None = None, *,
                   window: int = 0, sinks: int = 4, layout: str | None = None) -> HylaConfig:
    """The student's config: the teacher's shape with ``layers`` and ``kv_heads``; with
    ``window`` its ``G``, ``D`` and ``K`` layers are linearised attention keeping the last
    ``window`` and first ``sinks`` tokens exactly (``linear_window``, ``window_sinks``) beside
    a GLA (``G``) or gated-delta-rule (``D``, ``K``) branch. ``layout``: a transformers
    ``model_type`` whose family lays the student out (its options, norms; it exports as that
    family), e.g. ``qwen3_5_text``.

    Raises ValueError naming ``--layers`` or ``--student-kv-heads`` when they do not fit.

    Example:
        >>> from hyla.model import preset
        >>> t = dataclasses.replace(preset("debug"), layers="AAAA")
        >>> s = student_config(t, "GGGA", kv_heads=1)
        >>> s.layers, s.n_kv_heads, s.head_k_dim == t.head_dim
        ('GGGA', 1, True)
    """
    if any(MIXERS[c] is not AttentionMixer for c in teacher.layers):
        raise ValueError(f"the teacher must have only attention layers, got layers="
                         f"{teacher.layers!r}")
    if not isinstance(layers, str) or len(layers) != teacher.n_layers or set(layers) - set(MIXERS):
        raise ValueError(f"--layers must be a string of {teacher.n_layers} letters of "
                         f"{''.join(sorted(MIXERS))} (one per teacher layer), got {layers!r} "
                         f"({len(layers)} letters)")
    t_kv = teacher.n_kv_heads
    if kv_heads is None:
        kv_heads = t_kv
    if not isinstance(kv_heads, int) or kv_heads <= 0 or t_kv % kv_heads:
        raise ValueError(f"--student-kv-heads must divide the teacher's {t_kv} KV heads, "
                         f"got {kv_heads!r}")
    cfg = dataclasses.replace(teacher, layers=layers, n_kv_heads=kv_heads, expand_k=1.0,
                              expand_v=1.0, linear_window=window,
                              window_sinks=sinks if window else teacher.window_sinks)
    if layout is None:
        return cfg
    from hyla.model.formats.families import FAMILIES

    family = FAMILIES.get(layout)
    if family is None or family.layout is None:
        known = sorted(k for k, f in FAMILIES.items() if f.layout is not None)
        raise ValueError(f"no student layout {layout!r}: the families with one are {known}")
    return family.layout(cfg)


@torch.no_grad()
def build_student(teacher: HylaLM, layers: str, kv_heads: int | None = None, *,
                  window: int = 0, sinks: int = 4, layout: str | None = None) -> HylaLM:
    """A student for ``teacher`` (all-attention) with the layer mix ``layers`` (``window``,
    ``sinks``, ``layout``: see :func:`student_config`).

    Example:
        >>> from hyla.model import preset
        >>> t = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA")).eval()
        >>> s = build_student(t, "AAAA").eval()
        >>> ids = torch.randint(0, 256, (1, 9))
        >>> torch.equal(s(ids), t(ids))
        True
    """
    cfg = student_config(teacher.cfg, layers, kv_heads, window=window, sinks=sinks,
                         layout=layout)
    p = next(teacher.parameters())
    student = HylaLM(cfg).to(device=p.device, dtype=p.dtype)
    student.embed.weight.copy_(teacher.embed.weight)
    _copy_norm(teacher.norm, student.norm)
    if not cfg.tie_embeddings:
        student.lm_head.weight.copy_(teacher.lm_head.weight)
    for t_block, s_block in zip(teacher.blocks, student.blocks, strict=True):
        _copy_norm(t_block.mixer_norm, s_block.mixer_norm)
        if t_block.mlp_norm is not None:       # an FFN half (ffn letter "N" has none)
            _copy_norm(t_block.mlp_norm, s_block.mlp_norm)
        s_block.mlp.load_state_dict(t_block.mlp.state_dict())
        s_block.mixer.init_from_attention(t_block.mixer)
    return student


def _copy_norm(source, target) -> None:
    """The teacher's norm scale into the student's, whichever way each stores it."""
    target.weight.copy_(norm_weight(source.weight, source, target))


def transfer_layers(teacher_cfg: HylaConfig, student_cfg: HylaConfig) -> list[int]:
    """Indices of the student layers stage 1 trains: all but those its mixer copies exactly
    from the teacher's attention (an A layer with the teacher's KV heads)."""
    return [i for i, c in enumerate(student_cfg.layers)
            if not MIXERS[c].copies_attention(teacher_cfg, student_cfg)]


@torch.no_grad()
def calibrate_student(teacher: HylaLM, student: HylaLM, transfer: list[int], cfg,
                      tokenizer) -> dict:
    """Set the teacher-derived parts of the student's linearised layers (their
    ``calibrate``: the window/linear mix, the forget-gate timescales and, for ``D``/``K``,
    the delta rule's ``beta``) from the teacher's
    attention on one training block of ``cfg.stage1_len`` tokens; returns what each layer
    took, by layer index. Layers without ``calibrate`` are left alone."""
    from hyla.model import Context
    from hyla.train.distill.teacher_hooks import mixer_inputs

    layers = [i for i in transfer if hasattr(student.blocks[i].mixer, "calibrate")]
    if not layers:
        return {}
    device = next(teacher.parameters()).device
    ids, cu = (x.to(device) for x in probe_block(cfg, tokenizer))
    ctx = Context.train(ids, cu)
    seen = mixer_inputs(teacher, ids, ctx)
    found = {}
    for i in layers:
        q, k = teacher.blocks[i].mixer.attention_qk(seen.pop(i), ctx)
        found[str(i)] = student.blocks[i].mixer.calibrate(q, k, ctx.positions)
    return found



def probe_block(cfg, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [1, stage1_len], cu_seqlens)``: the first training block, on which the teacher's
    attention is measured before training (calibration, the choice of attention layers)."""
    from hyla.data.packing import corpus_blocks
    from hyla.train.batches import next_batch

    blocks = corpus_blocks(cfg.data, tokenizer, cfg.stage1_len, split="train", seed=cfg.seed)
    ids, _, cu = next_batch(blocks, 1)
    return ids, cu
