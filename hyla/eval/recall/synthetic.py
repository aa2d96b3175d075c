"""MQAR recall: train small GLA, hybrid and attention models and measure what they recall.

For each mixer (``GG`` all GLA, ``GA`` one GLA + one attention layer, ``AA`` all attention;
``quick`` adds ``DD`` all gated delta rule, ``DA`` one gated-delta + one attention layer and
``KK`` all KDA, the delta rule with a decay a key channel)
and each learning rate of the sweep, a fresh model is trained with AdamW on freshly sampled
MQAR batches (:mod:`hyla.eval.mqar`), then scored on held-out examples: accuracy is the
fraction of query positions whose argmax is the right value (Zoology's metric). The best
learning rate of each mixer (highest mean test accuracy) is the one reported and plotted.
Models share ``d_model``, heads and MLP width, so their parameter counts match to within the
mixers' own weights (reported per record). ``state_bytes`` is the per-sequence state at the
test length, from :func:`hyla.eval.memory.state_bytes`, with the attention keys and values
counted in fp32, the dtype these models run in.

Example:
    >>> p = RecallPreset(name="tiny", vocab_size=64, d_model=32, train=((32, 4),),
    ...                  test=((32, 4),), mixers=("AA",), lrs=(3e-3,), train_steps=2,
    ...                  batch_size=4, test_examples=4)
    >>> [r["mixer"] for r in run_recall(p, seed=0)]
    ['AA']
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyla.eval.memory import state_bytes
from hyla.eval.mqar import IGNORE, check_mqar_args, mqar
from hyla.eval.recall.models import build_model
from hyla.model import MIXERS, HylaConfig

DESCRIPTIONS = {"GG": "GLA only", "GA": "hybrid (GLA + attention)", "AA": "attention only",
                "DD": "Gated DeltaNet only", "DA": "hybrid (Gated DeltaNet + attention)",
                "KK": "KDA only (a decay a key channel)", "KA": "hybrid (KDA + attention)"}


@dataclass(frozen=True, kw_only=True)
class RecallPreset:
    """What to train, what to test, and how hard to train.

    ``train`` and ``test`` are ``(seq_len, num_kv_pairs)`` pairs; training cycles through the
    train shapes one batch at a time. ``curriculum`` is optional ``(until, shapes)`` phases:
    while ``step < until * train_steps`` the batches cycle through that phase's shapes
    instead (the first phase whose ``until`` is not yet reached), then through ``train``.
    ``lrs`` is the learning-rate sweep (each mixer is trained once per lr); ``mixer_lrs``
    gives some mixers their own sweep, ``(("GG", (3e-3,)),)``. ``warmup`` is a fraction of
    ``train_steps``; the lr then decays by cosine.
    """

    name: str
    vocab_size: int
    d_model: int
    train: tuple[tuple[int, int], ...]
    test: tuple[tuple[int, int], ...]
    mixers: tuple[str, ...] = ("GG", "GA", "AA")
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    mixer_lrs: tuple[tuple[str, tuple[float, ...]], ...] = ()
    curriculum: tuple[tuple[float, tuple[tuple[int, int], ...]], ...] = ()
    n_heads: int = 1
    ffn_dim: int | None = None  # None: 2 * d_model
    chunk_size: int = 64
    short_conv: int = 4  # Zoology's short causal conv before each mixer; 0 = none
    gate_logit_normalizer: float = 16.0  # GLA's forget-gate scale (16: the model default)
    train_steps: int = 1000
    batch_size: int = 64
    test_examples: int = 256
    weight_decay: float = 0.1
    warmup: float = 0.1
    random_filler: bool = True  # False: filler is token 0 (Zoology's random_non_queries)

    def __post_init__(self) -> None:
        phases = [shapes for _, shapes in self.curriculum]
        for shape in (*self.train, *self.test, *(s for ph in phases for s in ph)):
            check_mqar_args(self.vocab_size, *shape)
        ends = [until for until, _ in self.curriculum]
        if any(not 0 < u <= 1 for u in ends) or ends != sorted(ends) or not all(phases):
            raise ValueError(f"curriculum must be (until, shapes) phases with 0 < until <= 1 "
                             f"increasing and shapes given, got {self.curriculum}")
        for m in self.mixers:
            if not m or set(m) - set(MIXERS):
                raise ValueError(f"mixers must be layer strings of {sorted(MIXERS)}, got {m!r}")
        for lrs in (self.lrs, *(lrs for _, lrs in self.mixer_lrs)):
            if not lrs or any(lr <= 0 for lr in lrs):
                raise ValueError(f"lrs must be positive learning rates, got {lrs}")
        for name in ("train_steps", "batch_size", "test_examples"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def lrs_for(self, layers: str) -> tuple[float, ...]:
        """The learning rates ``layers`` is trained with."""
        return dict(self.mixer_lrs).get(layers, self.lrs)

    def shapes_at(self, step: int) -> tuple[tuple[int, int], ...]:
        """The training shapes of ``step`` (the curriculum's phase, else ``train``)."""
        for until, shapes in self.curriculum:
            if step < until * self.train_steps:
                return shapes
        return self.train

    def config(self, layers: str) -> HylaConfig:
        """The model for one mixer: same width, heads and MLP for every mixer."""
        return HylaConfig(vocab_size=self.vocab_size, d_model=self.d_model, layers=layers,
                          n_heads=self.n_heads, ffn_dim=self.ffn_dim or 2 * self.d_model,
                          chunk_size=self.chunk_size,
                          gate_logit_normalizer=self.gate_logit_normalizer)


def quick() -> RecallPreset:
    """d_model 128, 4 to 64 pairs at seq_len 64 to 256; GLA, gated delta rule (a decay a
    head, ``D``, or a key channel, ``K``) models, alone and with an attention layer, and all
    attention. About 4-6.5 CPU minutes a mixer (28 for the six; measured on a 2-core EPYC).

    What makes it learn in 1,000 steps (issue 33; the tuning runs are in the README): filler
    token 0 (Zoology's ``random_non_queries=False``: only the pairs write into the state),
    GLA's gates starting slow (``gate_logit_normalizer=256``: a 256-token half-life instead
    of 16), width 128, one learning rate of 1e-3 (3e-3 never leaves the plateau), and a
    curriculum that starts on 4 and 8 pairs before the longer, fuller sequences."""
    return RecallPreset(name="quick", vocab_size=320, d_model=128,
                        mixers=("GG", "GA", "AA", "DD", "DA", "KK"),
                        curriculum=((0.25, ((64, 4), (64, 8))),),
                        train=((64, 4), (64, 8), (64, 16), (128, 32), (256, 64)),
                        test=((64, 4), (128, 8), (128, 16), (128, 32), (256, 64)),
                        lrs=(1e-3,), train_steps=1000, batch_size=32, test_examples=128,
                        gate_logit_normalizer=256.0, random_filler=False)


def zoology() -> RecallPreset:
    """Zoology's MQAR sweep (vocab 8192); hours on a CPU, meant for a GPU."""
    return RecallPreset(name="zoology", vocab_size=8192, d_model=128,
                        train=((64, 4), (128, 8), (256, 16), (256, 32), (256, 64)),
                        test=((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128),
                              (1024, 256)),
                        lrs=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2), n_heads=1, train_steps=20000,
                        batch_size=64, test_examples=1000)


PRESETS: dict[str, Callable[[], RecallPreset]] = {"quick": quick, "zoology": zoology}


def recall_preset(name: str) -> RecallPreset:
    """A fresh recall preset by name: ``quick`` or ``zoology``.

    Example:
        >>> recall_preset("zoology").vocab_size
        8192
    """
    if name not in PRESETS:
        raise ValueError(f"unknown recall preset {name!r}: expected one of {sorted(PRESETS)}")
    return PRESETS[name]()


def _lr_at(step: int, p: RecallPreset, lr: float) -> float:
    warm = max(1, int(p.warmup * p.train_steps))
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, p.train_steps - warm)
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_model(p: RecallPreset, layers: str, lr: float, seed: int) -> tuple[nn.Module, float]:
    """Train a fresh ``layers`` model on MQAR; returns (model, final training loss)."""
    torch.manual_seed(seed)
    model = build_model(p.config(layers), p.short_conv)
    # As usual, no weight decay on norms and biases.
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(p.train_steps):
        shapes = p.shapes_at(step)
        seq_len, pairs = shapes[step % len(shapes)]
        # Fresh data each step (never the test seeds, which start at 2**31).
        batch = mqar(p.batch_size, seq_len, pairs, p.vocab_size,
                     seed=seed * 1_000_003 + step, random_filler=p.random_filler)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, p, lr)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(),
                               ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, float(loss.detach())


@torch.no_grad()
def accuracy(model: nn.Module, seq_len: int, num_kv_pairs: int, num_examples: int,
             seed: int, batch_size: int = 64, random_filler: bool = True) -> float:
    """Fraction of MQAR query positions where ``model``'s argmax is the paired value.

    Example:
        >>> from hyla.model.config import preset
        >>> from hyla.model import HylaLM
        >>> 0.0 <= accuracy(HylaLM(preset("debug")), 32, 4, 8, seed=0) <= 1.0
        True
    """
    vocab = model.cfg.vocab_size
    data = mqar(num_examples, seq_len, num_kv_pairs, vocab, seed=2**31 + seed,
                random_filler=random_filler)
    model.eval()
    correct = total = 0
    for start in range(0, num_examples, batch_size):
        x = data.inputs[start:start + batch_size]
        y = data.labels[start:start + batch_size]
        mask = y != IGNORE
        pred = model(x).argmax(-1)
        correct += int((pred[mask] == y[mask]).sum())
        total += int(mask.sum())
    return correct / total


def _state_bytes(p: RecallPreset, cfg: HylaConfig, seq_len: int) -> int:
    # fp32 keys and values: the dtype these models run in. A short conv keeps its last
    # kernel - 1 inputs (fp32) per layer at decode time: counted too, though small.
    conv = (p.short_conv - 1) * cfg.d_model * 4 * cfg.n_layers if p.short_conv else 0
    return state_bytes(cfg, seq_len, kv_dtype=torch.float32)["total"] + conv


def train_and_test(p: RecallPreset, layers: str, lr: float, seed: int,
                   threads: int | None = None) -> list[dict]:
    """Train one ``layers`` model at ``lr`` and score it at every test shape of ``p``: one
    record per test shape (see :func:`run_recall`; ``best`` is left False). ``threads``: torch
    threads for this call (a worker process of a parallel sweep runs one)."""
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = p.config(layers)
    start, cpu = time.perf_counter(), time.process_time()
    model, loss = train_model(p, layers, lr, seed)
    seconds = time.perf_counter() - start
    # CPU seconds of this process: close to the wall time of an idle machine when
    # one thread runs, whatever else shares the cores.
    cpu = time.process_time() - cpu
    params = sum(q.numel() for q in model.parameters())
    rows = []
    for i, (seq_len, pairs) in enumerate(p.test):
        acc = accuracy(model, seq_len, pairs, p.test_examples, seed=seed * 101 + i,
                       random_filler=p.random_filler)
        rows.append({"mixer": layers, "description": DESCRIPTIONS.get(layers, layers),
                     "seq_len": seq_len, "num_kv_pairs": pairs, "accuracy": acc,
                     "state_bytes": _state_bytes(p, cfg, seq_len),
                     "lr": lr, "seed": seed, "d_model": p.d_model, "params": params,
                     "train_steps": p.train_steps, "final_loss": loss,
                     "train_seconds": round(seconds, 1),
                     "train_cpu_seconds": round(cpu, 1), "best": False})
    return rows


def run_recall(p: RecallPreset, seed: int = 0,
               progress: Callable[[str], None] | None = None, jobs: int = 1) -> list[dict]:
    """Train and test every mixer at every lr of ``p``; one record per (mixer, lr, test shape).

    Records carry ``mixer`` (the layer string), ``description``, ``seq_len``,
    ``num_kv_pairs``, ``accuracy``, ``state_bytes``, ``lr``, ``seed``, ``d_model``,
    ``params``, ``train_steps``, ``final_loss``, ``train_seconds`` (wall),
    ``train_cpu_seconds`` (this process's CPU time) and ``best`` (True for
    the lr with the highest mean accuracy of that mixer: the one to report).

    ``jobs > 1`` trains that many models at once, each in its own process with one torch
    thread: these models are too small for two threads to share one matmul well, so separate
    trainings use the cores better. Results do not depend on ``jobs`` (each training seeds
    itself).
    """
    runs = [(layers, lr) for layers in p.mixers for lr in p.lrs_for(layers)]
    done: dict[tuple[str, float], list[dict]] = {}

    def report(key: tuple[str, float], rows: list[dict]) -> None:
        done[key] = rows
        if progress is not None:
            mean = sum(r["accuracy"] for r in rows) / len(rows)
            progress(f"{key[0]} lr={key[1]:g}: loss {rows[0]['final_loss']:.3f}, mean accuracy "
                     f"{mean:.3f} ({rows[0]['train_seconds']:.0f} s, "
                     f"{rows[0]['train_cpu_seconds']:.0f} CPU s)")

    if jobs > 1 and len(runs) > 1:
        import concurrent.futures
        import multiprocessing

        # spawn, not fork: a forked child of a process whose OpenMP pool already ran can hang
        with concurrent.futures.ProcessPoolExecutor(
                max_workers=min(jobs, len(runs)),
                mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(train_and_test, p, layers, lr, seed, 1): (layers, lr)
                       for layers, lr in runs}
            for future in concurrent.futures.as_completed(futures):
                report(futures[future], future.result())
    else:
        for layers, lr in runs:
            report((layers, lr), train_and_test(p, layers, lr, seed))
    records: list[dict] = []
    for layers in p.mixers:
        lrs = p.lrs_for(layers)
        best = max(lrs, key=lambda lr: sum(r["accuracy"] for r in done[layers, lr]))
        for lr in lrs:
            for r in done[layers, lr]:
                r["best"] = lr == best
            records.extend(done[layers, lr])
    return records


def best_records(records: list[dict]) -> list[dict]:
    """The records of each mixer's best learning rate."""
    return [r for r in records if r["best"]]


def with_steps(p: RecallPreset, **changes) -> RecallPreset:
    """``p`` with some fields changed (e.g. fewer steps for a smoke run)."""
    return dataclasses.replace(p, **changes)
