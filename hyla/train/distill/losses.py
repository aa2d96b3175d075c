"""Distillation losses: per-layer attention transfer (stage 1) and chunked vocabulary KL
(stage 2).

Stage 1 compares one student mixer with the teacher's attention on the teacher's own hidden
states: a normalised output MSE, ``||y_s - y_t||^2 / ||y_t||^2``, and for attention students
with compressed KV heads also KL(teacher attention || student attention) through
:func:`hyla.ops.streamkl.attention_kl`, which never materialises the T x T scores.

Stage 2's loss over the vocabulary is computed ``chunk`` tokens at a time: each chunk's
student and teacher logits, their softmaxes, the loss and the gradient with respect to the
chunk's hidden states and the output head are formed and dropped before the next chunk, so
the [tokens, vocab] float32 logits never exist whole (Liger-kernel style: the backward pass
only scales gradients computed in the forward pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.model import Context, HylaLM
from hyla.ops.streamkl import attention_kl


def positions_for(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Rotary positions [T] for a [B, T] batch, restarting at packed-document boundaries
    (as :meth:`HylaLM.forward` does)."""
    return Context.train(input_ids, cu_seqlens).positions


def final_hidden(model: HylaLM, input_ids: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The normed last hidden state [B, T, d_model] that ``model.lm_head`` maps to logits."""
    return model(input_ids, cu_seqlens=cu_seqlens, hidden=True)


def _mixer(layer, h, positions, cu_seqlens):
    return layer(h, Context("train", positions, cu_seqlens))


def layer_transfer_loss(teacher_layer, student_layer, h: torch.Tensor, positions: torch.Tensor,
                        cu_seqlens: torch.Tensor | None = None, *, kl_weight: float = 1.0,
                        y_teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Stage-1 loss of one student mixer against the teacher's attention on input ``h``.

    Args:
        teacher_layer: the teacher's attention mixer (frozen).
        student_layer: any mixer; one with an attention distribution of its own (softmax
            attention, possibly fewer KV heads) is also matched on it.
        h: [B, T, d_model] the teacher's normed hidden state entering this layer.
        positions: [T] rotary positions; cu_seqlens: packed documents (B == 1).
        kl_weight: weight of the attention KL (attention students only).
        y_teacher: the teacher layer's output on ``h``, if already computed.
    Returns:
        (loss, {"mse": float, "kl": float (attention students)}).

    Example:
        >>> import dataclasses
        >>> from hyla.model import preset
        >>> from hyla.model.mixers import AttentionMixer
        >>> a = AttentionMixer(dataclasses.replace(preset("debug"), layers="A"))
        >>> loss, parts = layer_transfer_loss(a, a, torch.randn(1, 8, 64), torch.arange(8))
        >>> loss.item(), parts["kl"]
        (0.0, 0.0)
    """
    ctx = Context("train", positions, cu_seqlens)
    if y_teacher is None:
        with torch.no_grad():
            y_teacher = teacher_layer(h, ctx)
    y_s = student_layer(h, ctx)
    yt = y_teacher.float()
    mse = (y_s.float() - yt).pow(2).mean() / yt.pow(2).mean().clamp_min(1e-12)
    parts = {"mse": mse.item()}
    loss = mse
    student_qk = student_layer.attention_qk(h, ctx)
    if student_qk is not None:
        with torch.no_grad():
            q_t, k_t = teacher_layer.attention_qk(h, ctx)
        kl = attention_kl(q_t, k_t, *student_qk, cu_seqlens=cu_seqlens)
        parts["kl"] = kl.item()
        loss = loss + kl_weight * kl
    return loss, parts


class _ChunkedVocabKL(torch.autograd.Function):
    """Loss and gradients over the vocabulary, ``chunk`` rows at a time (see module doc)."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)       # the logits' softmaxes need float32
    @torch.autocast("cuda", enabled=False)
    def forward(ctx, h_s, w_s, h_t, w_t, labels, kl_weight, ce_weight, chunk, temperature):
        N = h_s.shape[0]
        tau = temperature
        n_valid = int((labels != -100).sum())
        acc = torch.float64 if h_s.dtype == torch.float64 else torch.float32
        grad_h = torch.zeros_like(h_s, dtype=acc)
        grad_w = torch.zeros_like(w_s, dtype=acc)
        ws, wt = w_s.to(acc), w_t.to(acc)
        kl_sum = h_s.new_zeros((), dtype=acc)
        ce_sum = h_s.new_zeros((), dtype=acc)
        for start in range(0, N, chunk):
            hs = h_s[start:start + chunk].to(acc)
            z_s = hs @ ws.T                                       # [c, V]
            with torch.no_grad():
                z_t = h_t[start:start + chunk].to(acc) @ wt.T
            log_q = torch.log_softmax(z_s / tau, -1)
            log_p = torch.log_softmax(z_t / tau, -1)
            p = log_p.exp()
            kl_sum += tau * tau * (p * (log_p - log_q)).sum()
            # d(tau^2 KL)/dz_s = tau (q - p), averaged over all N rows
            g = (kl_weight * tau / N) * (log_q.exp() - p)
            del log_p, p, z_t
            lab = labels[start:start + chunk]
            valid = (lab != -100).nonzero().squeeze(1)
            if n_valid and valid.numel():
                log_q1 = log_q if tau == 1.0 else torch.log_softmax(z_s, -1)
                rows = log_q1[valid]
                ce_sum -= rows.gather(1, lab[valid, None]).sum()
                g_ce = rows.exp()
                g_ce[torch.arange(valid.numel(), device=g.device), lab[valid]] -= 1.0
                g[valid] += (ce_weight / n_valid) * g_ce
            grad_h[start:start + chunk] = g @ ws
            grad_w += g.T @ hs
        kl = kl_sum / N
        ce = ce_sum / max(n_valid, 1)
        ctx.save_for_backward(grad_h.to(h_s.dtype), grad_w.to(w_s.dtype))
        ctx.mark_non_differentiable(kl, ce)
        return kl_weight * kl + ce_weight * ce, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_loss, grad_w * grad_loss, None, None, None, None, None, None,
                None)


def chunked_vocab_kl(h_student: torch.Tensor, w_student: torch.Tensor, h_teacher: torch.Tensor,
                     w_teacher: torch.Tensor, labels: torch.Tensor, *, kl_weight: float = 1.0,
                     ce_weight: float = 1.0, chunk: int = 1024, temperature: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kl_weight * KL(teacher || student) + ce_weight * CE`` over the vocabulary, chunked.

    Args:
        h_student: [N, d] normed last hidden states of the student (requires grad).
        w_student: [V, d] the student's output head (requires grad).
        h_teacher, w_teacher: the teacher's [N, d_t] and [V, d_t] (no gradient).
        labels: [N] next-token ids, -100 where not scored (cross-entropy only; the KL is
            averaged over all N rows).
        chunk: rows a chunk: peak extra memory is a few [chunk, V] float32 tensors.
        temperature: softmax temperature of the KL term (scaled by temperature^2).
    Returns:
        (loss, kl, ce): the differentiable loss and its two detached parts (means), in
        float32 (float64 for float64 inputs).

    Example:
        >>> h = torch.randn(10, 8, requires_grad=True)
        >>> w = torch.randn(50, 8, requires_grad=True)
        >>> loss, kl, ce = chunked_vocab_kl(h, w, h.detach(), w.detach(),
        ...                                 torch.randint(0, 50, (10,)), chunk=3)
        >>> float(kl), bool(torch.isclose(loss, ce))
        (0.0, True)
    """
    if h_student.dim() != 2 or labels.shape != h_student.shape[:1]:
        raise ValueError(f"h_student must be [N, d] and labels [N], got "
                         f"{tuple(h_student.shape)} and {tuple(labels.shape)}")
    if chunk < 1 or temperature <= 0:
        raise ValueError(f"chunk must be >= 1 and temperature > 0, got {chunk}, {temperature}")
    return _ChunkedVocabKL.apply(h_student, w_student, h_teacher.detach(), w_teacher.detach(),
                                 labels, kl_weight, ce_weight, chunk, temperature)


def direct_vocab_kl(logits_s: torch.Tensor, logits_t: torch.Tensor, labels: torch.Tensor, *,
                    kl_weight: float = 1.0, ce_weight: float = 1.0, temperature: float = 1.0
                    ) -> torch.Tensor:
    """The materialised reference of :func:`chunked_vocab_kl` on [N, V] logits."""
    tau = temperature
    acc = torch.float64 if logits_s.dtype == torch.float64 else torch.float32
    zs, zt = logits_s.to(acc), logits_t.to(acc)
    kl = F.kl_div(torch.log_softmax(zs / tau, -1), torch.log_softmax(zt / tau, -1),
                  log_target=True, reduction="sum") * tau * tau / zs.shape[0]
    ce = F.cross_entropy(zs, labels, ignore_index=-100)
    return kl_weight * kl + ce_weight * ce
