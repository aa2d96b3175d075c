"""LoRA adapters on a model's linear layers, kept beside the weights and merged at the end.

``add_lora`` gives each chosen ``nn.Linear`` a low-rank update ``W + (alpha / r) B A`` through
a forward hook; ``A`` [r, in] and ``B`` [out, r] live in a ``lora`` module on the layer's
parent under the layer's name, and ``B`` starts at zero, so the model is unchanged until it
trains. The weights themselves stay where they were (plain names), so ``merge_lora`` folds the
updates in and leaves an ordinary model. A checkpoint saved before merging holds the adapters
too; it resumes in a model that :func:`add_lora` gave the same adapters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRA(nn.Module):
    """The adapter of one linear layer: ``A`` [rank, in], ``B`` [out, rank], ``scale``."""

    def __init__(self, layer: nn.Linear, rank: int, alpha: float):
        super().__init__()
        w = layer.weight
        self.a = nn.Parameter(torch.empty(rank, w.shape[1], device=w.device, dtype=w.dtype))
        self.b = nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.scale = alpha / rank

    def delta(self) -> torch.Tensor:
        return (self.b @ self.a) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float = 16.0, targets=TARGETS,
             within: str = "mixer") -> list[nn.Parameter]:
    """Adapters on every linear layer named in ``targets`` inside a module named ``within``;
    returns their parameters (the only ones a LoRA stage trains, with whatever else it picks).

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug")).eval()
        >>> ids = torch.randint(0, 256, (1, 6))
        >>> before = model(ids)
        >>> params = add_lora(model, 4)
        >>> len(params), torch.equal(model(ids), before)
        (32, True)
        >>> with torch.no_grad():
        ...     _ = params[1].fill_(0.01)
        >>> after = model(ids)
        >>> merge_lora(model)
        >>> torch.allclose(model(ids), after, atol=1e-5), hasattr(model.blocks[3].mixer, "lora")
        (True, False)
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank must be an int >= 1, got {rank!r}")
    params = []
    for name, parent in model.named_modules():
        if name.rsplit(".", 1)[-1] != within:
            continue
        adapters = nn.ModuleDict()
        for target in targets:
            layer = getattr(parent, target, None)
            if isinstance(layer, nn.Linear):
                adapter = LoRA(layer, rank, alpha)
                adapters[target] = adapter
                layer._lora_hook = layer.register_forward_hook(
                    lambda mod, args, out, a=adapter: out + (args[0] @ a.a.T.to(args[0].dtype)
                                                             @ a.b.T.to(args[0].dtype)) * a.scale)
                params += [adapter.a, adapter.b]
        if len(adapters):
            parent.lora = adapters
    return params


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its weight and remove it (a no-op without adapters)."""
    for parent in list(model.modules()):
        adapters = getattr(parent, "lora", None)
        if not isinstance(adapters, nn.ModuleDict):
            continue
        for target, adapter in adapters.items():
            layer = getattr(parent, target)
            layer.weight += adapter.delta().to(layer.weight.dtype)
            layer._lora_hook.remove()
            del layer._lora_hook
        del parent.lora


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(getattr(m, "lora", None), nn.ModuleDict) for m in model.modules())


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters, in :func:`add_lora`'s order."""
    return [p for m in model.modules() if isinstance(m, LoRA) for p in (m.a, m.b)]


def beside_lora(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that are neither an adapter nor an adapted layer's weight:
    what a LoRA stage trains whole in a layer that is new to the model (its gates, norms,
    convolutions), beside the adapters.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug"))
        >>> _ = add_lora(model, 2)
        >>> mixer = model.blocks[0].mixer
        >>> names = {id(p): n for n, p in mixer.named_parameters()}
        >>> [names[id(p)] for p in beside_lora(mixer)]
        ['gk_proj.0.weight', 'gk_proj.1.weight', 'gk_proj.1.bias', 'g_proj.weight', 'g_norm.weight']
    """
    adapters = getattr(module, "lora", None)
    adapted = ({f"{target}.weight" for target in adapters}
               if isinstance(adapters, nn.ModuleDict) else set())
    return [p for name, p in module.named_parameters()
            if not name.startswith("lora.") and name not in adapted]
