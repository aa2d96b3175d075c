"""What several ``hyla`` commands share: the parser class, flag types, thread setup, model
loading, byte formatting and the memory table. Imports no command module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib

from rich.console import Console
from rich.table import Table

from hyla.data.tokenizer import stop_ids
from hyla.model.config import PRESETS

DEFAULT_BUDGET_GIB = 80.0  # one 80 GB accelerator: the usual unit of a serving replica
QUICKSTART_DIR = "runs/quickstart"
SOURCE_HELP = ("a model name (hyla models lists them, e.g. smollm2), a hyla checkpoint or run "
               "directory, a transformers or fla directory, a .gguf file or a Hugging Face "
               "hub id (org/name)")
PRESETS_HELP = "one of " + ", ".join(PRESETS)


class ArgumentError(Exception):
    """Bad command-line input (``main`` prints it as one error line, exit status 2)."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, adding ``(default: X)`` to a flag's help where the help does not
    already say its default (switches, whose default is off, and flags without a default
    are left as they are).

    Example:
        >>> p = Parser(prog="x")
        >>> _ = p.add_argument("--steps", type=int, default=120, help="optimizer steps")
        >>> "optimizer steps (default: 120)" in " ".join(p.format_help().split())
        True
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default is None or action.default is argparse.SUPPRESS
                or isinstance(action.default, bool) or action.nargs == 0
                or action.default == ""):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    # argparse prints usage and exits by itself; we want one error path for all bad input.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(f"{self.prog}: {message}")


def positive(value: str) -> int:
    """argparse type for a positive int."""
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value!r}")
    return int(value)


def positive_float(value: str) -> float:
    """argparse type for a positive finite number (inf once reached the simulator as NaN)."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value!r}")
    return v


def format_bytes(n: float) -> str:
    """Decimal units, as the published figures use (29.5 MB, 2.42 GB).

    Example:
        >>> format_bytes(28311552), format_bytes(2415919104)
        ('28.3 MB', '2.42 GB')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Use ``n`` torch threads inside the block (restored after: main() may run in-process)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def add_allow_nonfinite(p: argparse.ArgumentParser) -> None:
    """``--allow-nonfinite`` on a command that loads a model (``main`` applies it around the
    whole command: :func:`hyla.model.finite.allowing_nonfinite`)."""
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load a model whose weights hold NaN or inf anyway, to inspect it "
                        "(default: refused, naming the tensor)")


def add_sampling(p: argparse.ArgumentParser, max_tokens: int, threads: int | None, *,
                 temperature: float = 1.0, top_p: float = 1.0,
                 threads_help: str | None = None) -> None:
    """The sampling flags of ``generate``, ``chat`` and ``quickstart``."""
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most new tokens a reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=temperature,
                   help="softmax temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens only (default: all)")
    p.add_argument("--top-p", type=float, default=top_p,
                   help="nucleus sampling: the smallest set of tokens whose probability "
                        "reaches p; 1 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (and the weights' seed with --preset) "
                        "(default: %(default)s)")
    # One-token decode of a small model is latency bound: extra threads mostly add
    # synchronisation, and on a busy machine they can cost 10x.
    p.add_argument("--threads", type=positive, default=threads,
                   help=threads_help or "torch CPU threads (default: "
                        f"{'torch' + chr(39) + 's choice' if threads is None else threads})")


def check_sampling(args: argparse.Namespace) -> None:
    """ValueError naming the flag when a sampling flag of :func:`add_sampling` is out of
    range."""
    if args.max_tokens < 0:
        raise ValueError(f"max-tokens must be >= 0, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k <= 0:
        raise ValueError(f"top-k must be a positive int, got {args.top_k}")
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        raise ValueError(f"top-p must be in (0, 1], got {args.top_p}")




def speculative_method(value: str) -> str:
    """argparse type of ``--speculative``: ``ngram``, ``mtp`` or ``draft:SOURCE``.

    Example:
        >>> speculative_method("draft:smollm2")
        'draft:smollm2'
    """
    from hyla.serve.speculative import check_speculative

    try:
        check_speculative(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative: ")) from None
    if not value.removeprefix("draft:").strip() and value not in ("ngram", "mtp"):
        raise argparse.ArgumentTypeError("draft:SOURCE needs a model after 'draft:' (a hyla "
                                         "or transformers checkpoint directory, a GGUF file, "
                                         "or a known name such as smollm2)")
    return value


def add_speculative(p: argparse.ArgumentParser, applies: str) -> None:
    """``--speculative``, ``--num-speculative-tokens`` and ``--draft-quantize`` (``serve``,
    ``generate``, ``chat``); ``applies``: when speculation runs."""
    from hyla.model.quantize import SCHEMES

    p.add_argument("--speculative", type=speculative_method, default=None,
                   metavar="{ngram,mtp,draft:SOURCE}",
                   help=f"speculative decoding ({applies}): ngram drafts tokens by looking "
                        f"the last few up earlier in the text; mtp drafts with the model's own "
                        f"multi-token-prediction layers (Qwen3-Next's, Qwen3.5's, "
                        f"MiMo-V2-Flash's); "
                        f"draft:SOURCE has a smaller (or "
                        f"quantised) model sharing the tokenizer draft them. The drafts are "
                        f"verified in one forward: the output stays the model's own")
    p.add_argument("--num-speculative-tokens", type=positive, default=4, metavar="N",
                   help="drafts a step with --speculative (default: %(default)s)")
    p.add_argument("--draft-quantize", choices=("auto", *SCHEMES), default="auto",
                   help="how the draft:SOURCE model is quantised, as --quantize (default: "
                        "%(default)s; a draft's rounding costs speed, never output)")


def generate_text(model, tok, prompt: str, args: argparse.Namespace, timing=None,
                  drafter=None) -> str:
    """The completion of ``prompt`` under the sampling flags of :func:`add_sampling`;
    ``timing`` (a :class:`hyla.model.stream.StreamTiming`) receives the speeds; ``drafter``:
    speculative decoding's (:func:`hyla.cli.model_flags.drafter`)."""
    import torch

    from hyla.model.stream import stream_tokens
    from hyla.serve.session import RunnerState

    if not prompt:
        raise ValueError("prompt must be non-empty text")
    check_sampling(args)
    gen = torch.Generator(device=model.anchor.device).manual_seed(args.seed)
    # the serving runner's decode step (KV read in place, last-row logits)
    new = list(stream_tokens(model, RunnerState(model), tok.encode(prompt), args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k,
                             top_p=getattr(args, "top_p", 1.0), generator=gen,
                             stop_ids=stop_ids(tok), timing=timing, drafter=drafter))
    return tok.decode(new)


def speed_line(load_s: float | None, timing) -> str:
    """One line on how fast a generation went (``hyla generate`` prints it to stderr).

    Example:
        >>> from hyla.model.stream import StreamTiming
        >>> speed_line(1.5, StreamTiming(prompt_tokens=10, prompt_s=0.5, new_tokens=11,
        ...                              decode_s=2.0))
        'load 1.50 s, prompt 10 tokens at 20.0 tok/s, decode 11 tokens at 5.0 tok/s'
    """
    parts = [] if load_s is None else [f"load {load_s:.2f} s"]
    prompt = timing.prompt_tok_s
    parts.append(f"prompt {timing.prompt_tokens} tokens"
                 + (f" at {prompt:.1f} tok/s" if prompt == prompt else ""))
    rate = timing.decode_tok_s
    parts.append(f"decode {timing.new_tokens} tokens" +
                 (f" at {rate:.1f} tok/s" if rate == rate else ""))
    return ", ".join(parts)


def random_model(preset_name: str, seed: int | None):
    """A randomly initialised model of the preset, with the byte tokenizer's vocabulary."""
    import torch

    from hyla.data import ByteTokenizer
    from hyla.model import HylaLM
    from hyla.model.config import preset

    tok = ByteTokenizer()
    # Random weights for now: the preset's vocabulary is swapped for bytes so every sampled id
    # decodes. Trained checkpoints will bring their own tokenizer.
    cfg = dataclasses.replace(preset(preset_name), vocab_size=tok.vocab_size)
    torch.manual_seed(0 if seed is None else seed)
    return HylaLM(cfg).eval(), tok


def all_cores() -> int:
    """The CPU threads a long job gets by default: ``$OMP_NUM_THREADS`` when set, else every
    core this process may run on.

    Example:
        >>> all_cores() >= 1
        True
    """
    import os

    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def format_seconds(s: float) -> str:
    """``75.2`` -> ``'1 min 15 s'``.

    Example:
        >>> format_seconds(9.54), format_seconds(75.2), format_seconds(3725)
        ('9.5 s', '1 min 15 s', '62 min 5 s')
    """
    if s < 60:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(round(s % 60))} s"


def finished_line(record: dict, out_dir, stage: bool = False) -> str:
    """What ``train`` and ``distill`` say at the end of a run: its last step's validation
    loss, or, for a run resumed after its last step, that there was nothing left to do."""
    at = f"step {record['step']}" + (f" (stage {record['stage']})" if stage else "")
    if "val_loss" not in record and "loss" not in record:
        return f"{at}: the run was already complete; its checkpoints are in {out_dir}"
    return (f"{at}: validation loss {record.get('val_loss', float('nan')):.3f}; "
            f"checkpoint in {out_dir}")


def refuse_existing_run(out_dir, command: str, hint: str = "") -> None:
    """ValueError when ``out_dir`` already holds a run (checkpoints, metrics): a new run
    there would overwrite its metrics and settings while its newer checkpoints stayed, and
    loading the directory would give the old model."""
    path = pathlib.Path(out_dir)
    if not path.is_dir():
        return
    held = sorted(p.name for p in path.iterdir()
                  if p.name.startswith("ckpt-") or p.name in ("metrics.jsonl", "run.json"))
    if held:
        shown = ", ".join(held[-3:]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{path} already holds a training run ({shown}): "
                         + (hint or f"continue it with hyla {command} --resume {path} if "
                                    f"{command} wrote it, or give another --out"))


def train_quickstart(out: Console, *, preset: str = "small", steps: int = 120,
                     out_dir: str = QUICKSTART_DIR, threads: int | None = None) -> str:
    """Train the quickstart model (a BPE tokenizer, then ``steps`` AdamW steps on the Python
    standard library's source) into ``out_dir`` on ``threads`` torch threads (default: every
    core); returns ``out_dir``. ``hyla quickstart``, ``hyla serve`` and ``hyla cluster``
    (with no checkpoint) call it.

    It says what it expects to take, from the time of its first steps, before the rest, and
    validates at 6 points (the loss plot shows a curve)."""
    import time

    from hyla.train.config import quickstart_config
    from hyla.train.trainer import Trainer

    threads = threads or all_cores()
    evals = 6
    cfg = quickstart_config(preset=preset, steps=steps, out=out_dir,
                            eval_every=max(1, steps // evals))
    out.print(f"Training [bold]{cfg.preset}[/] for {cfg.steps} steps of "
              f"{cfg.tokens_per_step:,} tokens on the Python standard library's source, "
              f"{threads} thread{'s' * (threads > 1)} (a byte-level BPE of "
              f"{cfg.vocab_size:,} tokens is trained first):")
    start = time.perf_counter()
    with torch_threads(threads):
        trainer = Trainer(cfg)
        if steps > 3:
            # The first step also fills the shuffle buffer; the next two time a step.
            trainer.loop.fit(until=1, progress=False)
            probe = time.perf_counter()
            trainer.loop.fit(until=3, progress=False)
            done = trainer.loop.step
            per_step = (time.perf_counter() - probe) / (done - 1)
            # a validation reads eval_batches blocks forward only: about a third of a step
            # of as many blocks
            rest = per_step * (steps - done) * (1 + evals * cfg.eval_batches /
                                                (3 * cfg.batch_size * steps))
            out.print(f"[bold]Expected: about {format_seconds(rest)} more[/] "
                      f"({per_step:.2f} s a step, measured on the first steps; "
                      f"{format_seconds(time.perf_counter() - start)} so far)")
        record = trainer.fit()
    out.print(f"validation loss [bold]{record['val_loss']:.3f}[/] nats/token after "
              f"{record['tokens']:,} tokens, trained in "
              f"{format_seconds(time.perf_counter() - start)}; checkpoint in {cfg.out} "
              f"(hyla generate --checkpoint {cfg.out} --prompt ...)")
    return cfg.out


def load_model(args: argparse.Namespace, out: Console):
    """(model, tokenizer, default model name) for the serve arguments (``--preset``,
    ``--checkpoint``, ``--seed``, ``--device``): with neither, the quickstart model, trained
    first if missing. ``--checkpoint`` is any :func:`hyla.model.load_model` source."""
    import torch

    from hyla.model.formats.checkpoint import CONFIG, latest_checkpoint
    from hyla.model.load import load_model as load_source
    from hyla.model.load import model_name, require_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.preset is not None:
        model, tok = random_model(args.preset, args.seed)
        out.print(f"[dim](preset {args.preset}: random weights, the text is noise)[/]")
        return model.to(device), tok, f"hyla-{args.preset}"
    path = args.checkpoint
    if path is None:
        path = QUICKSTART_DIR
        if not (latest_checkpoint(pathlib.Path(path)) / CONFIG).is_file():
            out.print(f"No checkpoint in {path}: training the quickstart model first.")
            train_quickstart(out)
    model, tok = load_source(path, device=device)
    needs = f"hyla {getattr(args, 'command', None) or 'serve'}"
    return model, require_tokenizer(tok, path, needs), model_name(path)


def memory_table(report: dict) -> Table:
    """``hyla memory``'s table of a :func:`hyla.eval.memory.memory_report`."""
    name = report["preset"] or "config"
    table = Table(title=f"Per-sequence memory of {name} at {report['context']:,} tokens")
    table.add_column("")
    table.add_column("hybrid", justify="right")
    table.add_column("all-attention", justify="right")
    kinds = report["kinds"]

    def short(dtype: str) -> str:
        return "bf16" if dtype == "bfloat16" else "fp32" if dtype == "float32" else dtype

    table.add_row("layers", " + ".join(f"{r['layers']} {r['label']}" for r in kinds
                                       if r["layers"]),
                  " + ".join(f"{r['baseline_layers']} {r['label']}" for r in kinds
                             if r["baseline_layers"]))
    for r in kinds:
        table.add_row(f"{r['state_label']} ({short(r['dtype'])})", format_bytes(r["bytes"]),
                      format_bytes(r["baseline_bytes"]) if r["baseline_layers"] else "-")
    groups = {g: b for g, b in report.get("state_groups", {}).items() if b}
    if len(groups) > 1:         # the engine's pools: paged blocks, window rings, states
        table.add_row("by memory group", ", ".join(f"{g} {format_bytes(b)}"
                                                   for g, b in groups.items()), "-")
    table.add_row("[bold]per sequence[/]", f"[bold]{format_bytes(report['state_bytes'])}[/]",
                  f"[bold]{format_bytes(report['kv_bytes'])}[/]")
    table.add_row("bytes", f"{report['state_bytes']:,}", f"{report['kv_bytes']:,}")
    table.add_row("[bold]ratio[/]", f"[bold]{report['ratio']:.1f}x less[/]", "1x")
    wd = "bf16" if report["weight_dtype"] == "bfloat16" else report["weight_dtype"]
    table.add_row("parameters", f"{report['params'] / 1e6:,.1f}M",
                  f"{report['attention_params'] / 1e6:,.1f}M")
    table.add_row(f"weights ({wd})", format_bytes(report["weight_bytes"]),
                  format_bytes(report["attention_weight_bytes"]))
    fit = report["sequences_fit"]
    if fit is not None:
        def show(v: int | None) -> str:
            return "unbounded" if v is None else f"{v:,}"
        table.add_row(f"sequences in {report['budget_gib']:g} GiB", show(fit["hybrid"]),
                      show(fit["attention"]))
    return table


def published_line(report: dict) -> str | None:
    """How the report compares with the figures published for its model, if any."""
    pub = report.get("published")
    if not pub:
        return None
    return (f"Published for this model: {format_bytes(pub['state_bytes'])} of state, "
            f"~{pub['ratio']:.0f}x less than the KV cache; this config gives "
            f"{format_bytes(report['state_bytes'])}, {report['ratio']:.1f}x.")
