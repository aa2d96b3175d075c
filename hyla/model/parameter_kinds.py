"""Which of a model's parameters are hidden matrices and which are tables and vectors: the
split Muon and AdamW take (:mod:`hyla.train.optim.param_groups`, whose docstring says why),
which the training-memory plan (:mod:`hyla.eval.train_memory`) counts too.
"""

from __future__ import annotations

from torch import nn


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]],
                                            list[tuple[str, nn.Parameter]]]:
    """Split ``model``'s trainable parameters into (Muon, AdamW) lists of ``(name, param)``.

    Embeddings (every ``nn.Embedding``) and the output head (``model.lm_head``, tied or not)
    go to AdamW along with every non-2-D parameter; the other 2-D weights go to Muon. A tied
    parameter appears once.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> muon, adamw = split_params(HylaLM(preset("debug")))
        >>> [n for n, _ in adamw][:3]
        ['embed.weight', 'blocks.0.mixer_norm.weight', 'blocks.0.mixer.gk_proj.1.bias']
        >>> "blocks.0.mixer.gk_proj.0.weight" in dict(muon)
        True
    """
    table_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        table_ids.add(id(head.weight))
    muon, adamw = [], []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        if p.ndim == 2 and id(p) not in table_ids:
            muon.append((name, p))
        else:
            adamw.append((name, p))
    return muon, adamw
