"""Training run settings: one dataclass the CLI maps its flags onto."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OPTIMIZERS = ("muon", "adamw")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
MUON_STRATEGIES = ("all_to_all", "all_gather")  # DistMuon's, under torchrun
# how W > 1 ranks train (hyla.train.strategies): fsdp, diloco, fomoe
STRATEGIES = ("fsdp", "diloco", "fomoe")
PLANNED_STRATEGIES: tuple[str, ...] = ()  # none left


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs besides the model preset's shape.

    Example:
        >>> TrainConfig(steps=10, seq_len=64).tokens_per_step
        512
    """

    preset: str = "small"
    layers: str | None = None  # override the preset's layer mix, e.g. "AAAAAAAA" (a teacher)
    # start from this model (any hyla.model.load_model source): its config, weights and
    # tokenizer replace the preset's
    init: str | None = None
    data: str | None = None  # None: the embedded stdlib corpus
    out: str = "runs/small"
    steps: int = 200
    seq_len: int = 256
    batch_size: int = 8  # blocks per micro-batch
    shuffle_buffer: int = 1024  # blocks mixed at once (hyla.data.packing); 0: file order only
    grad_accum: int = 1
    optimizer: str = "muon"
    lr: float = 3e-3  # AdamW (and Muon's AdamW-side parameters)
    muon_lr: float = 0.02
    muon_strategy: str = "all_to_all"  # multi-process runs: how DistMuon shares matrices
    strategy: str = "fsdp"  # multi-process runs: FSDP2 shards (hyla.train.strategies.fsdp)
    # diloco / fomoe: inner steps between outer syncs, and the outer Nesterov SGD
    sync_every: int = 16
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    expert_replicas: int = 0  # fomoe: workers holding each expert (1..W); 0: all W
    token_skipping: bool = True  # fomoe: drop the pairs routed to experts held elsewhere
    sync_timeout: float = 600.0  # diloco / fomoe: seconds a sync waits for a silent rank
    device: str = "cpu"  # "cuda": under torchrun each rank on cuda:LOCAL_RANK (nccl)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # warmup-stable-decay: the last 20% of steps decay to 0
    clip: float = 1.0
    precision: str = "fp32"  # "bf16": autocast (fast on GPUs and AMX CPUs, slow elsewhere)
    activation_checkpointing: bool = False
    offload_activations: bool = False
    save_every: int = 100
    keep_last: int = 2
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    seed: int = 0
    vocab_size: int = 8192
    tokenizer_documents: int = 400  # training documents the BPE learns from

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "save_every", "keep_last",
                     "eval_batches", "vocab_size", "tokenizer_documents", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.muon_strategy not in MUON_STRATEGIES:
            raise ValueError(f"muon_strategy must be one of {MUON_STRATEGIES}, "
                             f"got {self.muon_strategy!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got "
                             f"--outer-lr {self.outer_lr} --outer-momentum "
                             f"{self.outer_momentum}")
        if self.expert_replicas < 0:
            raise ValueError(f"expert_replicas must be >= 1 (or 0: every worker), got "
                             f"{self.expert_replicas}")
        if self.expert_replicas and self.strategy != "fomoe":
            raise ValueError(f"--expert-replicas is fomoe's: pass --strategy fomoe, or drop "
                             f"--expert-replicas {self.expert_replicas}")
        if not self.sync_timeout > 0:
            raise ValueError(f"sync_timeout must be > 0 seconds, got {self.sync_timeout}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must be in [0, 1], got {self.decay_fraction}")
        for name in ("lr", "muon_lr", "weight_decay"):     # before any work (a tokenizer)
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name.replace('_', '-')} must be a finite number >= 0, got "
                                 f"{getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.clip < float("inf"):      # NaN fails too; 0: no clipping
            raise ValueError(f"clip must be a finite number >= 0 (0: no clipping), got "
                             f"{self.clip}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def wsd_lr_factor(step: int, cfg: TrainConfig) -> float:
    """Warmup-stable-decay: linear warmup, flat, then linear decay to zero at the last step.

    Example:
        >>> cfg = TrainConfig(steps=100, warmup_steps=10, decay_fraction=0.2)
        >>> [round(wsd_lr_factor(s, cfg), 2) for s in (0, 9, 50, 80, 90, 99)]
        [0.1, 1.0, 1.0, 1.0, 0.5, 0.05]
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = int(cfg.steps * cfg.decay_fraction)
    decay_start = cfg.steps - decay_steps
    if decay_steps and step >= decay_start:
        return (cfg.steps - step) / decay_steps
    return 1.0


def quickstart_config(*, preset: str = "small", steps: int = 120,
                      out: str = "runs/quickstart", **changes) -> TrainConfig:
    """What ``hyla quickstart`` trains: about three minutes on a 2-core CPU for ``small``.

    AdamW (at a CPU-sized batch Muon's Newton-Schulz costs more than the model itself), and
    blocks mixed through the shuffle buffer so that consecutive batches come from many files.
    ``benchmarks/data_mixing.py`` measured the choices at this budget (validation loss across
    the validation split after 120 steps): the buffer 5.95 vs file order 6.82; lr 2e-3 5.84 vs
    3e-3 5.95 and 5e-3 6.17; 8 x 128 tokens a step 6.03 (at 3e-3).

    Example:
        >>> cfg = quickstart_config(steps=10)
        >>> cfg.optimizer, cfg.tokens_per_step, cfg.warmup_steps
        ('adamw', 1024, 5)
    """
    base = dict(preset=preset, steps=steps, seq_len=256, batch_size=4, optimizer="adamw",
                lr=2e-3, warmup_steps=min(5, steps), shuffle_buffer=1024, save_every=steps,
                eval_batches=4, out=out)
    return TrainConfig(**{**base, **changes})
