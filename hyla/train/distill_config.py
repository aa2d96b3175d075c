"""Settings of a distillation run: one dataclass the ``hyla distill`` flags map onto."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyla.train.config import OPTIMIZERS

AUTOCAST = ("auto", "bf16", "off")


@dataclass(kw_only=True)
class DistillConfig:
    """Teacher, student pattern, the two stages' lengths and optimiser settings.

    Stage 1 (attention transfer) trains only the student layers that differ from the teacher
    (``G`` layers, and ``A`` layers with fewer KV heads), each on the teacher's own hidden
    states, for ``stage1_steps`` steps of ``batch_size`` blocks of ``stage1_seq_len`` tokens.
    Stage 2 trains the whole student end to end for ``stage2_steps`` steps of ``seq_len``.

    Example:
        >>> cfg = DistillConfig(teacher="t", layers="GGGA", stage1_seq_len=4096)
        >>> cfg.stage1_tokens_per_step, cfg.tokens_per_step
        (16384, 2048)
    """

    teacher: str = ""  # a transformers directory (Llama/Mistral/Qwen2) or a hyla checkpoint
    layers: str = ""  # the student's layer mix, one letter per teacher layer
    out: str = "runs/distill"
    student_kv_heads: int | None = None  # None: the teacher's
    # The student's G layers as linearised attention (hyla.model.mixers.window_gla): exact
    # softmax over the last `window` tokens and the first `sinks`, plus a normalised GLA
    # branch. 0: plain GLA layers (new projections, no window).
    window: int = 0
    sinks: int = 4
    lora_rank: int = 0  # stage 2: LoRA of this rank on the mixers' q/k/v/o (0: full tuning)
    lora_alpha: float = 16.0
    eval_every: int = 0  # also print held-out perplexity every this many steps (0: stage ends)
    autocast: str = "auto"  # bf16 autocast: "auto" (where bf16 matmuls are fast), "bf16", "off"
    report_tokens: int = 16384  # held-out tokens a perplexity of report.json (0: no report)
    report_trials: int = 8  # passkey trials a context length in report.json
    eval_data: str | None = None  # held-out text of the report (None: the stdlib validation)
    data: str | None = None  # None: the embedded stdlib corpus
    stage1_steps: int = 100
    stage2_steps: int = 200
    seq_len: int = 512  # stage 2 (and validation)
    stage1_seq_len: int | None = None  # None: seq_len
    batch_size: int = 4
    shuffle_buffer: int = 256  # blocks of seq_len mixed at once; stage 1 holds as many tokens
    optimizer: str = "muon"
    lr: float = 3e-3  # stage 2, AdamW (and Muon's AdamW-side parameters)
    muon_lr: float = 0.02
    stage1_lr: float = 3e-3
    stage1_muon_lr: float = 0.02
    attn_kl_weight: float = 1.0  # stage 1, compressed attention layers
    kl_weight: float = 1.0  # stage 2
    ce_weight: float = 1.0
    temperature: float = 1.0
    vocab_chunk: int = 1024  # tokens a chunk of the stage-2 vocabulary KL
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    clip: float = 1.0
    weight_decay: float = 0.0
    activation_checkpointing: bool = False
    save_every: int = 100
    keep_last: int = 2
    eval_batches: int = 8
    seed: int = 0
    precision: str = "fp32"  # the validation loss reads it; distillation runs in fp32

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "vocab_chunk", "save_every", "keep_last",
                     "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        for name in ("stage1_steps", "stage2_steps", "warmup_steps", "shuffle_buffer", "window",
                     "sinks", "lora_rank", "eval_every", "report_tokens", "report_trials"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if self.stage1_steps + self.stage2_steps == 0:
            raise ValueError("stage1-steps + stage2-steps must be >= 1")
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
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay-fraction must be in [0, 1], got {self.decay_fraction}")

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
