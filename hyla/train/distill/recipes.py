"""Named distillation recipes: what ``hyla distill --recipe NAME`` builds and how it trains.

A recipe fills every :class:`~hyla.train.distill.config.DistillConfig` field the user left at
``None`` ("from the recipe"); an explicit flag overrides that one part. The default,
``window-gla``, is the measured recipe of docs/distillation.md (SmolLM2-135M: held-out
perplexity 0.99x the teacher's at 2,048 tokens, passkey kept, 21 minutes on 2 CPU cores):
about a quarter of the teacher's layers stay softmax attention (chosen by the teacher,
``--layers auto``), the rest become linearised attention (a 64-token window + 4 sinks beside
a GLA branch), stage 2 trains LoRA adapters of rank 8 at 1e-3, 80 + 90 steps of 1,024 tokens.

Example:
    >>> r = RECIPES["window-gla"]
    >>> r.linear, r.window, r.lora_rank, r.attention_layers(30)
    ('G', 64, 8, 7)
    >>> resolve_layers("linear", r, 4), resolve_layers("auto", r, 30)
    ('GGGG', 'auto:7')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_RECIPE = "window-gla"


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One recipe: the student's linear letter, its window, and the training settings it
    fills in (the DistillConfig fields of the same names)."""

    name: str
    summary: str
    linear: str = "G"            # the letter of every layer that does not stay attention
    attention_share: float = 0.25  # --layers auto: this share of the teacher's layers stay A
    window: int = 64
    sinks: int = 4
    lora_rank: int = 8
    lr: float = 1e-3
    stage1_steps: int = 80
    stage2_steps: int = 90
    seq_len: int = 1024
    batch_size: int = 1
    warmup_steps: int = 5
    chat_data: int = 0     # teacher conversations mixed into the data (0: code alone)
    # the shipped layout (a transformers model_type with a Family.layout) the student takes,
    # so that it exports as that family; None: hyla's own layers
    layout: str | None = None

    def attention_layers(self, n_layers: int) -> int:
        """How many of ``n_layers`` stay softmax attention under ``--layers auto``: the
        floor of ``attention_share * n_layers``, at least 1 and at most ``n_layers - 1`` (7 of
        SmolLM2's 30, the measured recipe; 1 of 4)."""
        if n_layers < 2:
            return 0
        return min(n_layers - 1, max(1, int(self.attention_share * n_layers)))

    def settings(self) -> dict:
        """The DistillConfig fields this recipe sets, by name."""
        return {f: getattr(self, f) for f in RECIPE_FIELDS}


# DistillConfig fields a recipe fills where the config leaves them None.
RECIPE_FIELDS = ("window", "sinks", "lora_rank", "lr", "stage1_steps",
                 "stage2_steps", "seq_len", "batch_size", "warmup_steps", "chat_data")

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="window-gla",
           summary="a quarter of the layers attention (chosen by the teacher), the rest "
                   "linearised GLA (64-token window + 4 sinks), LoRA 8 in stage 2 (the "
                   "measured recipe)"),
    Recipe(name="plain-gla",
           summary="plain GLA layers (no window), full fine-tuning with Muon in stage 2 "
                   "(hyla's earlier defaults, at the same token budget)",
           window=0, lora_rank=0, lr=3e-3),
    Recipe(name="window-delta",
           summary="as window-gla, with linearised gated-delta (D) layers",
           linear="D"),
    Recipe(name="window-kda",
           summary="as window-gla, with linearised Kimi delta attention (K) layers",
           linear="K"),
    Recipe(name="qwen3.5",
           summary="Qwen3.5's text layout, which transformers, llama.cpp and vLLM run: a "
                   "quarter of the layers gated softmax attention with q/k norms (chosen by "
                   "the teacher), the rest Gated DeltaNet with its short convolution; no "
                   "window or sinks (the layout has none); the data half the teacher's "
                   "answers in its chat template; LoRA 8 in stage 2, with the new layers' "
                   "gates and norms trained whole",
           linear="D", window=0, layout="qwen3_5_text", chat_data=192),
)}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ValueError naming it and the known ones otherwise."""
    if name not in RECIPES:
        raise ValueError(f"unknown --recipe {name!r}: choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def windowed_form(letter: str):
    """The class a ``letter`` layer becomes with ``linear_window > 0``, or None where the
    mixer has no windowed (linearised-attention) form. A mixer declares it as its
    ``windowed`` class attribute (``G``:
    :class:`~hyla.model.mixers.linearised.gla.WindowedGLAMixer`) or by handling
    ``linear_window`` itself (``supports_linear_window = True``)."""
    from hyla.model.mixers import MIXERS

    cls = MIXERS[letter]
    if getattr(cls, "supports_linear_window", False):
        return cls
    windowed = getattr(cls, "windowed", None)
    # declared on this class, or a form of it (K inheriting D's windowed form of D has none)
    if windowed is None or ("windowed" not in vars(cls) and not issubclass(windowed, cls)):
        return None
    return windowed


def check_windowable(recipe: Recipe, window: int) -> None:
    """ValueError when ``window > 0`` and the recipe's linear letter has no windowed form."""
    from hyla.model.mixers import MIXERS

    if recipe.linear not in MIXERS:
        raise ValueError(f"--recipe {recipe.name!r}: its linear letter {recipe.linear!r} is no "
                         f"registered mixer ({''.join(sorted(MIXERS))})")
    if window > 0 and windowed_form(recipe.linear) is None:
        raise ValueError(f"--recipe {recipe.name!r}: the {recipe.linear} mixer "
                         f"({MIXERS[recipe.linear].__name__}) has no windowed form, so it cannot "
                         f"take --window {window}; use --window 0 (plain {recipe.linear} layers) "
                         f"or --recipe window-gla")


def resolve_layers(spec: str, recipe: Recipe, n_layers: int) -> str:
    """The concrete ``--layers``: ``auto`` -> ``auto:N`` (N from the recipe), ``linear`` ->
    the recipe's letter everywhere, ``auto:N`` checked against ``n_layers``; a pattern as it
    is (its length is checked when the student is built)."""
    if spec == "auto":
        return f"auto:{recipe.attention_layers(n_layers)}"
    if spec == "linear":
        return recipe.linear * n_layers
    if spec.startswith("auto"):
        count = spec.partition(":")[2]
        try:
            n = int(count)
        except ValueError:
            n = None
        if spec.partition(":")[1] != ":" or n is None or not 0 <= n <= n_layers:
            raise ValueError(f"--layers {spec!r}: auto:N needs N in 0..{n_layers} (the "
                             f"teacher's {n_layers} layers; N softmax attention layers to keep)")
    return spec


def resolve(cfg, n_layers: int):
    """``cfg`` with every None field filled from its recipe and ``layers`` made concrete for
    a teacher of ``n_layers`` layers (idempotent: a resolved config resolves to itself)."""
    recipe = get_recipe(cfg.recipe)
    filled = {f: v for f, v in recipe.settings().items() if getattr(cfg, f) is None}
    layers = resolve_layers(cfg.layers or "auto", recipe, n_layers)
    window = filled.get("window", cfg.window)
    if layers.startswith("auto") or layers == recipe.linear * n_layers:
        check_windowable(recipe, window)
    return dataclasses.replace(cfg, layers=layers, **filled)
