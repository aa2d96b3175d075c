"""Build a hybrid student from an all-attention teacher, weights copied where they fit.

The student has the teacher's width, depth, vocabulary, embeddings, MLPs and norms. Its layer
mix is a pattern such as ``"GGGA" * 4``:

- ``A`` layers copy the teacher's attention. With fewer KV heads (``kv_heads``, KV-cache
  compression) each student KV head is the mean of the group of teacher KV heads it replaces:
  query head ``h`` read teacher KV head ``h // (H / H_kv)``, and that head falls in student
  group ``h // (H / H_s)``, so every query keeps reading a merge of the head it used to read.
  Rotary is linear and the same for every head, so the merged rotated key is the rotated
  merged key.
- ``G`` layers take q, k, v and o from the teacher's attention (``expand_k = expand_v = 1`` so
  each GLA head has the teacher's head dim; KV heads repeated for every query head). GLA uses
  no positions, so the rotary part of the teacher is what stage 1 must make up for. The
  forget gates start input-independent (``gk_proj.1.weight = 0``) with biases spreading each
  head's key channels over forgetting time scales of 16 to 4,096 tokens, log-uniformly:
  slow forgetting, so the layer starts close to the long memory of the attention it replaces.
  ``g_proj`` and the per-head output norm keep their fresh initialisation.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hyla.model import HylaConfig, HylaLM

TIMESCALES = (16.0, 4096.0)  # tokens: the slowest and fastest forgetting of the initial gates


def student_config(teacher: HylaConfig, layers: str, kv_heads: int | None = None
                   ) -> HylaConfig:
    """The student's config: the teacher's shape with ``layers`` and ``kv_heads``.

    Raises ValueError naming ``--layers`` or ``--student-kv-heads`` when they do not fit.

    Example:
        >>> from hyla.model import preset
        >>> t = dataclasses.replace(preset("debug"), layers="AAAA")
        >>> s = student_config(t, "GGGA", kv_heads=1)
        >>> s.layers, s.n_kv_heads, s.head_k_dim == t.head_dim
        ('GGGA', 1, True)
    """
    if set(teacher.layers) != {"A"}:
        raise ValueError(f"the teacher must have only attention layers, got layers="
                         f"{teacher.layers!r}")
    if not isinstance(layers, str) or len(layers) != teacher.n_layers or set(layers) - {"G", "A"}:
        raise ValueError(f"--layers must be a string of {teacher.n_layers} letters G or A (one "
                         f"per teacher layer), got {layers!r} ({len(layers)} letters)")
    t_kv = teacher.n_kv_heads
    if kv_heads is None:
        kv_heads = t_kv
    if not isinstance(kv_heads, int) or kv_heads <= 0 or t_kv % kv_heads:
        raise ValueError(f"--student-kv-heads must divide the teacher's {t_kv} KV heads, "
                         f"got {kv_heads!r}")
    return dataclasses.replace(teacher, layers=layers, n_kv_heads=kv_heads, expand_k=1.0,
                               expand_v=1.0)


def merge_kv_heads(weight: torch.Tensor, heads: int, new_heads: int) -> torch.Tensor:
    """[heads * D, d] projection rows -> [new_heads * D, d], each new head the mean of a group.

    Example:
        >>> w = torch.arange(8.0)[:, None]          # 4 heads of D = 2
        >>> merge_kv_heads(w, 4, 2)[:, 0].tolist()
        [1.0, 2.0, 5.0, 6.0]
    """
    D = weight.shape[0] // heads
    return weight.view(new_heads, heads // new_heads, D, -1).mean(1).reshape(new_heads * D, -1)


def expand_kv_heads(weight: torch.Tensor, heads: int, new_heads: int) -> torch.Tensor:
    """[heads * D, d] -> [new_heads * D, d], head ``j`` repeated for its ``new_heads / heads``
    query heads (GQA order: query head ``h`` reads KV head ``h // (new_heads / heads)``)."""
    D = weight.shape[0] // heads
    return weight.view(heads, D, -1).repeat_interleave(new_heads // heads, 0).reshape(
        new_heads * D, -1)


def slow_gate_bias(cfg: HylaConfig) -> torch.Tensor:
    """Gate biases [key_dim]: per head, key channels forget over 16 ... 4,096 tokens.

    The log forget gate is ``logsigmoid(b) / normalizer``; a channel that keeps ``exp(-1 /
    tau)`` of its memory a token needs ``logsigmoid(b) = -normalizer / tau``, i.e.
    ``b = -log(expm1(normalizer / tau))``.
    """
    lo, hi = TIMESCALES
    tau = torch.logspace(math.log10(lo), math.log10(hi), cfg.head_k_dim, dtype=torch.float64)
    b = -torch.log(torch.expm1(cfg.gate_logit_normalizer / tau))
    return b.repeat(cfg.n_heads).float()


@torch.no_grad()
def build_student(teacher: HylaLM, layers: str, kv_heads: int | None = None) -> HylaLM:
    """A student for ``teacher`` (all-attention) with the layer mix ``layers``.

    Example:
        >>> from hyla.model import preset
        >>> t = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA")).eval()
        >>> s = build_student(t, "AAAA").eval()
        >>> ids = torch.randint(0, 256, (1, 9))
        >>> torch.equal(s(ids), t(ids))
        True
    """
    cfg = student_config(teacher.cfg, layers, kv_heads)
    tc = teacher.cfg
    p = next(teacher.parameters())
    student = HylaLM(cfg).to(device=p.device, dtype=p.dtype)
    student.embed.weight.copy_(teacher.embed.weight)
    student.norm.weight.copy_(teacher.norm.weight)
    if not cfg.tie_embeddings:
        student.lm_head.weight.copy_(teacher.lm_head.weight)
    for t_block, s_block in zip(teacher.blocks, student.blocks, strict=True):
        s_block.mixer_norm.load_state_dict(t_block.mixer_norm.state_dict())
        s_block.mlp_norm.load_state_dict(t_block.mlp_norm.state_dict())
        s_block.mlp.load_state_dict(t_block.mlp.state_dict())
        t, s = t_block.mixer, s_block.mixer
        s.q_proj.weight.copy_(t.q_proj.weight)
        s.o_proj.weight.copy_(t.o_proj.weight)
        if s_block.kind == "attention":
            s.k_proj.weight.copy_(merge_kv_heads(t.k_proj.weight, tc.n_kv_heads, cfg.n_kv_heads))
            s.v_proj.weight.copy_(merge_kv_heads(t.v_proj.weight, tc.n_kv_heads, cfg.n_kv_heads))
        else:
            s.k_proj.weight.copy_(expand_kv_heads(t.k_proj.weight, tc.n_kv_heads, cfg.n_heads))
            s.v_proj.weight.copy_(expand_kv_heads(t.v_proj.weight, tc.n_kv_heads, cfg.n_heads))
            s.gk_proj[1].weight.zero_()
            s.gk_proj[1].bias.copy_(slow_gate_bias(cfg))
    return student


def transfer_layers(teacher_cfg: HylaConfig, student_cfg: HylaConfig) -> list[int]:
    """Indices of the student layers stage 1 trains: every G, and A with compressed KV heads
    (an A layer with the teacher's KV heads is an exact copy: nothing to learn)."""
    compressed = student_cfg.n_kv_heads != teacher_cfg.n_kv_heads
    return [i for i, c in enumerate(student_cfg.layers) if c == "G" or compressed]
