"""Settings of a distillation run: one dataclass the ``hyla distill`` flags map onto.

Fields a recipe sets (:mod:`hyla.train.distill.recipes`: ``window``, ``sinks``, ``lora_rank``,
``lr``, the steps, ``seq_len``, ``batch_size``, ``warmup_steps``) default to None, "from the
recipe"; :meth:`DistillConfig.resolve` fills them (and makes ``layers`` concrete) once the
teacher's depth is known. The resolved config is what a run saves and reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyla.train.config import OPTIMIZERS
from hyla.train.distill.recipes import get_recipe, resolve

AUTOCAST = ("auto", "bf16", "off")
LAYER_RANKINGS = ("probes", "kl")
# report.json by default: one perplexity length on this many held-out tokens, passkey at 1K
# with this many trials; --full-report: two lengths on 16K tokens, passkey at 1K and 2K, 8 trials
REPORT_TOKENS, REPORT_TRIALS = 4096, 2
FULL_REPORT_TOKENS, FULL_REPORT_TRIALS = 16384, 8


@dataclass(kw_only=True)
class DistillConfig:
    """Teacher, student pattern, the two stages' lengths and optimiser settings.

    Stage 1 (attention transfer) trains only the student layers that differ from the teacher
    (``G`` layers, and ``A`` layers with fewer KV heads), each on the teacher's own hidden
    states, for ``stage1_steps`` steps of ``batch_size`` blocks of ``stage1_seq_len`` tokens.
    Stage 2 trains the whole student end to end for ``stage2_steps`` steps of ``seq_len``.

    Example:
        >>> cfg = DistillConfig(teacher="t", layers="GGGA", stage1_seq_len=4096,
        ...                     batch_size=4, seq_len=512)
        >>> cfg.stage1_tokens_per_step, cfg.tokens_per_step
        (16384, 2048)
        >>> r = DistillConfig(teacher="t").resolve(30)
        >>> r.layers, r.window, r.lora_rank, r.seq_len, r.report_tokens
        ('auto:7', 64, 8, 1024, 4096)
    """

    teacher: str = ""  # a transformers directory (Llama/Mistral/Qwen2) or a hyla checkpoint
    recipe: str = "window-gla"  # hyla.train.distill.recipes.RECIPES: fills the None fields
    # the student's layer mix, one letter per teacher layer; "auto" (auto:N, N a quarter of
    # the layers), "auto:N" (N attention layers chosen by the teacher), "linear" (none)
    layers: str = "auto"
    layer_ranking: str = "probes"  # how auto:N ranks the teacher's layers: "probes" or "kl"
    out: str = "runs/distill"
    student_kv_heads: int | None = None  # None: the teacher's
    # The student's linear layers (G; D, K where their mixer has the windowed form) as
    # linearised attention (hyla.model.mixers.linearised.gla): exact softmax over the last
    # `window` tokens and the first `sinks`, plus a normalised recurrent branch. 0: plain
    # linear layers. None (like every field below left None): the recipe's.
    window: int | None = None
    sinks: int | None = None
    lora_rank: int | None = None  # stage 2: LoRA of this rank on q/k/v/o (0: full tuning)
    lora_alpha: float = 16.0
    eval_every: int = 0  # also print held-out perplexity every this many steps (0: stage ends)
    autocast: str = "auto"  # bf16 autocast: "auto" (where bf16 matmuls are fast), "bf16", "off"
    report_tokens: int | None = None  # held-out tokens a report perplexity (0: no report)
    report_trials: int | None = None  # passkey trials a context length in report.json
    full_report: bool = False  # report.json at 512 and 2,048 tokens, passkey at 1K and 2K
    report_tasks: str | None = None  # comma-separated lm-eval tasks scored in report.json
    include_path: str | None = None  # a folder of local lm-eval task configs
    eval_data: str | None = None  # held-out text of the report (None: the stdlib validation)
    data: str | None = None  # None: the embedded stdlib corpus
    # teacher conversations mixed into the training data (hyla.train.distill.chat_data):
    # this many requests answered by the teacher in its chat template, `chat_share` of the
    # tokens; 0: none
    chat_data: int | None = None
    chat_share: float = 0.5
    stage1_steps: int | None = None
    stage2_steps: int | None = None
    seq_len: int | None = None  # stage 2 (and validation)
    stage1_seq_len: int | None = None  # None: seq_len
    batch_size: int | None = None
    shuffle_buffer: int = 256  # blocks of seq_len mixed at once; stage 1 holds as many tokens
    optimizer: str = "muon"
    lr: float | None = None  # stage 2, AdamW (and Muon's AdamW-side parameters)
    muon_lr: float = 0.02
    stage1_lr: float = 3e-3
    stage1_muon_lr: float = 0.02
    attn_kl_weight: float = 1.0  # stage 1, compressed attention layers
    kl_weight: float = 1.0  # stage 2
    ce_weight: float = 1.0
    temperature: float = 1.0
    vocab_chunk: int = 1024  # tokens a chunk of the stage-2 vocabulary KL
    warmup_steps: int | None = None
    decay_fraction: float = 0.2
    clip: float = 1.0
    weight_decay: float = 0.0
    activation_checkpointing: bool = False
    save_every: int = 100
    keep_last: int = 2
    eval_batches: int = 4  # 4 blocks of seq_len: 4,096 tokens with the default recipe
    seed: int = 0
    precision: str = "fp32"  # the validation loss reads it; distillation runs in fp32

    def __post_init__(self) -> None:
        get_recipe(self.recipe)                     # ValueError naming an unknown recipe
        for name in ("seq_len", "batch_size", "vocab_chunk", "save_every", "keep_last",
                     "eval_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        for name in ("stage1_steps", "stage2_steps", "warmup_steps", "shuffle_buffer", "window",
                     "sinks", "lora_rank", "eval_every", "report_tokens", "report_trials",
                     "chat_data"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if not 0 <= self.clip < float("inf"):
            raise ValueError(f"clip must be a finite number >= 0 (0: no clipping), got "
                             f"{self.clip}")
        if self.stage1_steps == 0 and self.stage2_steps == 0:
            raise ValueError("stage1-steps + stage2-steps must be >= 1")
        if self.layer_ranking not in LAYER_RANKINGS:
            raise ValueError(f"layer-ranking must be one of {LAYER_RANKINGS}, got "
                             f"{self.layer_ranking!r}")
        if self.report_tasks is not None and not self.tasks:
            raise ValueError(f"report-tasks must name at least one lm-eval task, got "
                             f"{self.report_tasks!r}")
        if self.stage1_seq_len is not None and self.stage1_seq_len < 1:
            raise ValueError(f"stage1-seq-len must be >= 1, got {self.stage1_seq_len}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision != "fp32":
            raise ValueError(f"precision must be 'fp32' for distillation, got {self.precision!r}")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {AUTOCAST}, got {self.autocast!r}")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora-alpha must be > 0, got {self.lora_alpha}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.chat_share <= 1:
            raise ValueError(f"chat-share must be in (0, 1], got {self.chat_share}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay-fraction must be in [0, 1], got {self.decay_fraction}")

    def resolve(self, n_layers: int) -> DistillConfig:
        """This config for a teacher of ``n_layers`` layers: every None field from the recipe
        (:func:`hyla.train.distill.recipes.resolve`), ``layers`` concrete (``auto`` ->
        ``auto:N``, ``linear`` -> the recipe's letter everywhere), the report's sizes set.
        Idempotent."""
        cfg = resolve(self, n_layers)
        full = cfg.full_report
        return dataclasses.replace(
            cfg,
            report_tokens=(cfg.report_tokens if cfg.report_tokens is not None
                           else FULL_REPORT_TOKENS if full else REPORT_TOKENS),
            report_trials=(cfg.report_trials if cfg.report_trials is not None
                           else FULL_REPORT_TRIALS if full else REPORT_TRIALS))

    @property
    def tasks(self) -> list[str]:
        """``report_tasks`` as a list of task names."""
        return [t.strip() for t in (self.report_tasks or "").split(",") if t.strip()]

    @property
    def stage1_len(self) -> int:
        return self.stage1_seq_len or self.seq_len

    @property
    def stage1_tokens_per_step(self) -> int:
        return self.stage1_len * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
