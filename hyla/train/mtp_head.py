"""Train a model's multi-token-prediction head on the model itself (self-distillation), so
``--speculative mtp`` can draft for a model whose checkpoint ships no MTP layers (SmolLM2,
a distilled hybrid): the model is frozen, and the head learns, from each position's final
hidden state and the next token, the model's own distribution for the token after that.

The loss at pair p (hidden state h[p], token t[p + 1]) is KL(model(. | t[..p + 1]) ||
head(h[p], t[p + 1])): the model's logits at position p + 1 are the target, so the head
learns what the model would pick (what a verify keeps), not what the text happened to say.

Example:
    >>> import torch
    >>> from hyla.model import HylaLM
    >>> from hyla.model.config import HylaConfig
    >>> model = HylaLM(HylaConfig(vocab_size=64, d_model=32, layers="GA", n_heads=4,
    ...                           ffn_dim=64))
    >>> model = with_mtp_head(model)
    >>> opt = torch.optim.AdamW(model.mtp.parameters(), lr=1e-3)
    >>> first = mtp_distill_step(model, torch.randint(0, 64, (2, 16)), opt)
    >>> all(mtp_distill_step(model, torch.randint(0, 64, (2, 16)), opt) < 10 for _ in range(3))
    True
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from hyla.model import HylaLM
from hyla.model.context import Context
from hyla.model.mtp import MTPHead


def with_mtp_head(model: HylaLM) -> HylaLM:
    """``model`` with a fresh one-layer MTP head (its config's ``mtp_layers`` 1; drafting
    runs the first layer alone), on the model's device and in its dtype, and the rest of it
    frozen (no gradients). The block starts as a copy of the stack's last softmax-attention
    layer (a better start than noise). Train it before quantising the model."""
    if getattr(model, "quantized", None) not in (None, "none"):
        raise ValueError(f"with_mtp_head: the model is quantised ({model.quantized}): give it "
                         f"a head, train it, then quantise")
    if "A" not in model.cfg.layers:
        raise ValueError(f"with_mtp_head: the model has no softmax-attention layer ('A') for "
                         f"the head to copy (layers {model.cfg.layers!r})")
    cfg = dataclasses.replace(model.cfg, mtp_layers=1)
    head = MTPHead(cfg)
    torch.nn.init.normal_(head.fc.weight, 0.0, cfg.initializer_range)   # as HylaLM's
    at = model.cfg.layers.rindex("A")
    for block in head.layers:
        block.load_state_dict(model.blocks[at].state_dict())
    p = model.anchor
    model.requires_grad_(False)
    model.cfg, model.mtp = cfg, head.to(device=p.device, dtype=p.dtype)
    return model


def mtp_distill_step(model: HylaLM, ids: torch.Tensor, opt: torch.optim.Optimizer,
                     hidden: torch.Tensor | None = None) -> float:
    """One step of the head's self-distillation on token rows ``ids`` [B, T] (T >= 3); the
    rest of the model is not touched. ``hidden``: the model's final hidden states of those
    rows (``model(ids, hidden=True)``), kept from an earlier pass over the same data (the
    model's forward is most of a step's work). Returns the loss."""
    if ids.dim() != 2 or ids.shape[1] < 3:
        raise ValueError(f"ids must be [B, T] with T >= 3, got {tuple(ids.shape)}")
    if getattr(model, "mtp", None) is None:
        raise ValueError("the model has no MTP head to train: with_mtp_head(model) first")
    with torch.no_grad():
        h = model(ids, hidden=True) if hidden is None else hidden      # [B, T, d]
        want = F.log_softmax(model.lm_head(h[:, 1:-1]).float(), dim=-1)
    nxt = ids[:, 1:-1]                  # pairs p = 0 .. T - 3: (h[p], t[p + 1]) -> t[p + 2]
    with torch.no_grad():
        e = model.embed_tokens(nxt)
    g = model.mtp(e, h[:, :-2], Context.train(nxt))
    got = F.log_softmax(model.lm_head(g).float(), dim=-1)
    loss = F.kl_div(got.flatten(0, 1), want.flatten(0, 1), log_target=True,
                    reduction="batchmean")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), 1.0)
    opt.step()
    return float(loss.detach())
