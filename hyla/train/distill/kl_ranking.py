"""A KL-guided ranking of the teacher's layers for ``--layers auto:N --layer-ranking kl``.

The induction and reach probes (:mod:`hyla.train.distill.layer_ranking`) guess which layers a
student needs as softmax attention from the teacher's attention patterns. This ranking reads
the objective distillation minimises instead (the KL-guided layer selection of fla-org's
hybrid distillation work):

1. build the all-linear student (every layer the windowed linear mixer ``linear``, started
   from the teacher's q/k/v/o) and calibrate it as distillation does, without training;
2. for each layer ``i``, put the teacher's own attention mixer back at ``i`` only (the mixer
   object is swapped in and out; nothing is copied) and measure the vocabulary
   KL(teacher || student) on a few blocks of training text;
3. a layer's score is the KL it removes: ``KL(all linear) - KL(layer i restored)``, in nats
   a token.

Layers before ``i`` are the all-linear student's either way, so the residual stream entering
each block is computed once and each restored student runs from block ``i`` on: scoring
``L`` layers costs about ``L / 2 + 1`` student forwards plus ``L + 1`` passes of the two
output heads (the teacher's once, when its log-probabilities fit ``cache_bytes``). The
vocabulary KL is taken ``chunk`` tokens at a time, so no ``[T, vocab]`` float32 logits exist
whole beyond that bounded cache. The ranking is one-shot (each layer scored alone, against the
all-linear student), not greedy: a greedy pick (restore the best, re-score the rest) costs
``N`` times as much.
"""

from __future__ import annotations

import contextlib

import torch

from hyla.model import Context, HylaLM
from hyla.train.distill.student import build_student, transfer_layers


@torch.no_grad()
def linear_student(teacher: HylaLM, block: tuple, *, window: int, sinks: int,
                   linear: str = "G") -> HylaLM:
    """The all-linear student (every layer ``linear``, windowed) built from ``teacher`` and
    calibrated on ``block`` = ``(ids [1, T], cu_seqlens)`` as distillation calibrates its
    students (:func:`hyla.train.distill.student.calibrate_student`), in eval mode."""
    from hyla.train.distill.teacher_hooks import mixer_inputs

    student = build_student(teacher, linear * teacher.cfg.n_layers, window=window,
                            sinks=sinks).eval()
    layers = [i for i in transfer_layers(teacher.cfg, student.cfg)
              if hasattr(student.blocks[i].mixer, "calibrate")]
    if layers:
        ids, cu = block
        ctx = Context.train(ids, cu)
        seen = mixer_inputs(teacher, ids, ctx)
        for i in layers:
            q, k = teacher.blocks[i].mixer.attention_qk(seen.pop(i), ctx)
            student.blocks[i].mixer.calibrate(q, k, ctx.positions)
    return student


@contextlib.contextmanager
def _restored(student: HylaLM, teacher: HylaLM, i: int):
    """``student`` with the teacher's attention mixer at layer ``i`` (the same object)."""
    own = student.blocks[i].mixer
    student.blocks[i].mixer = teacher.blocks[i].mixer
    try:
        yield student
    finally:
        student.blocks[i].mixer = own


@torch.no_grad()
@torch.autocast("cpu", enabled=False)
def _teacher_log_probs(h_t: torch.Tensor, w_t: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The teacher's float32 log-probabilities, ``chunk`` rows a tensor."""
    wt = w_t.float()
    return [torch.log_softmax(h_t[s:s + chunk].float() @ wt.T, -1)
            for s in range(0, h_t.shape[0], chunk)]


@torch.no_grad()
@torch.autocast("cpu", enabled=False)
def _kl_sum(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor,
            chunk: int, cached: list[torch.Tensor] | None = None) -> float:
    """Sum over the rows of h [N, d] of KL(softmax(h_t w_t^T) || softmax(h_s w_s^T)), in
    float32, ``chunk`` rows at a time (the teacher's side from ``cached`` when given)."""
    total = 0.0
    ws = w_s.float()
    for n, start in enumerate(range(0, h_s.shape[0], chunk)):
        log_q = torch.log_softmax(h_s[start:start + chunk].float() @ ws.T, -1)
        log_p = (cached[n] if cached is not None else
                 _teacher_log_probs(h_t[start:start + chunk], w_t, chunk)[0])
        total += float((log_p.exp() * (log_p - log_q)).sum())
    return total


@torch.no_grad()
def restored_kl(teacher: HylaLM, blocks, *, window: int, sinks: int, linear: str = "G",
                chunk: int = 512, cache_bytes: int = 2 ** 28, student: HylaLM | None = None
                ) -> tuple[float, list[float]]:
    """``(KL of the all-linear student, [KL with layer i restored for each i])``, nats a token
    averaged over ``blocks`` (see the module doc).

    Args:
        teacher: an all-attention :class:`HylaLM` (eval mode).
        blocks: a few ``(ids [1, T], cu_seqlens or None)`` of training text; the first also
            calibrates the student.
        window, sinks: the student's linear window and attention sinks.
        linear: the letter of the student's linear layers (``"G"``).
        chunk: tokens a chunk of the vocabulary KL.
        cache_bytes: the teacher's float32 log-probabilities of a block are computed once
            and kept when they take at most this many bytes (``T * vocab * 4``; 256 MiB:
            a 1,300-token block at SmolLM2's 49,152 tokens), else once a layer, a chunk at a
            time.
        student: an all-linear student to use instead of :func:`linear_student`'s.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("restored_kl needs at least one (ids, cu_seqlens) block of text")
    device = next(teacher.parameters()).device
    blocks = [(ids.to(device), None if cu is None else cu.to(device)) for ids, cu in blocks]
    if student is None:
        student = linear_student(teacher, blocks[0], window=window, sinks=sinks, linear=linear)
    n = teacher.cfg.n_layers
    base, restored, tokens = 0.0, [0.0] * n, 0
    for ids, cu in blocks:
        ctx = Context.train(ids, cu)
        h_t = teacher(ids, ctx, hidden=True).flatten(0, 1)
        w_t = teacher.lm_head.weight
        cached = (_teacher_log_probs(h_t, w_t, chunk)
                  if h_t.shape[0] * w_t.shape[0] * 4 <= cache_bytes else None)

        def kl(x, h_t=h_t, cached=cached):
            h_s = student.norm(x).flatten(0, 1)
            return _kl_sum(h_s, student.lm_head.weight, h_t, teacher.lm_head.weight, chunk,
                           cached)

        entering = []                   # the residual stream entering each student block
        x = student.embed_tokens(ids)
        for b in student.blocks:
            entering.append(x)
            x = b(x, ctx)
        base += kl(x)
        for i in range(n):
            with _restored(student, teacher, i):
                x = entering[i]
                for b in student.blocks[i:]:
                    x = b(x, ctx)
            restored[i] += kl(x)
        tokens += ids.numel()
    return base / tokens, [r / tokens for r in restored]


def kl_layer_scores(teacher: HylaLM, blocks, *, window: int, sinks: int,
                    linear: str = "G") -> list[float]:
    """Per layer, the vocabulary KL(teacher || student) that putting the teacher's softmax
    attention back at that layer alone removes from the all-linear windowed student, nats a
    token on ``blocks`` (``[(ids [1, T], cu_seqlens)]``; module doc). Higher: keep it as
    attention.

    Example:
        >>> import dataclasses
        >>> from hyla.model import preset
        >>> t = HylaLM(dataclasses.replace(preset("debug"), layers="AAA")).eval()
        >>> s = kl_layer_scores(t, [(torch.randint(0, 256, (1, 40)), None)], window=4, sinks=1)
        >>> len(s)
        3
    """
    base, restored = restored_kl(teacher, blocks, window=window, sinks=sinks, linear=linear)
    return [base - r for r in restored]
