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

DEFAULT_BUDGET_GIB = 80.0  # one 80 GB accelerator: the usual unit of a serving replica
QUICKSTART_DIR = "runs/quickstart"
SOURCE_HELP = ("a hyla checkpoint or run directory, a transformers or fla directory, a .gguf "
               "file or a Hugging Face hub id")


class ArgumentError(Exception):
    """Bad command-line input (``main`` prints it as one error line, exit status 2)."""


class Parser(argparse.ArgumentParser):
    # argparse prints usage and exits by itself; we want one error path for all bad input.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(f"{self.prog}: {message}")


def positive(value: str) -> int:
    """argparse type for a positive int."""
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value!r}")
    return int(value)


def positive_float(value: str) -> float:
    """argparse type for a positive number."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
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


def add_sampling(p: argparse.ArgumentParser, max_tokens: int, threads: int | None) -> None:
    """The sampling flags of ``generate`` and ``quickstart``."""
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    # One-token decode of a small model is latency bound: extra threads mostly add
    # synchronisation, and on a busy machine they can cost 10x.
    p.add_argument("--threads", type=positive, default=threads,
                   help="torch CPU threads (default: "
                        f"{'torch' + chr(39) + 's choice' if threads is None else threads})")


def generate_text(model, tok, prompt: str, args: argparse.Namespace) -> str:
    """The completion of ``prompt`` under the sampling flags of :func:`add_sampling`."""
    import torch

    from hyla.model.generate import generate

    if not prompt:
        raise ValueError("prompt must be non-empty text")
    if args.max_tokens < 0:
        raise ValueError(f"max-tokens must be >= 0, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k <= 0:
        raise ValueError(f"top-k must be a positive int, got {args.top_k}")
    # stop at the end-of-text token, as transformers' generate does
    eos = getattr(tok, "eos_id", None)
    stops = (() if eos is None else (eos,)) + tuple(getattr(tok, "stop_ids", ()))
    with torch.inference_mode():
        new = generate(model, tok.encode(prompt), args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, stop_ids=stops)
    return tok.decode(new)


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


def train_quickstart(out: Console, *, preset: str = "small", steps: int = 120,
                     out_dir: str = QUICKSTART_DIR) -> str:
    """Train the quickstart model (a BPE tokenizer, then ``steps`` AdamW steps on the Python
    standard library's source) into ``out_dir``; returns ``out_dir``. ``hyla quickstart``,
    ``hyla serve`` and ``hyla cluster`` (with no checkpoint) call it."""
    from hyla.train.config import quickstart_config
    from hyla.train.trainer import Trainer

    cfg = quickstart_config(preset=preset, steps=steps, out=out_dir)
    out.print(f"Training [bold]{cfg.preset}[/] for {cfg.steps} steps of "
              f"{cfg.tokens_per_step:,} tokens on the Python standard library's source "
              f"(a byte-level BPE of {cfg.vocab_size:,} tokens is trained first):")
    record = Trainer(cfg).fit()
    out.print(f"validation loss [bold]{record['val_loss']:.3f}[/] nats/token after "
              f"{record['tokens']:,} tokens; checkpoint in {cfg.out} "
              f"(hyla generate --checkpoint {cfg.out} --prompt ...)")
    return cfg.out


def load_model(args: argparse.Namespace, out: Console):
    """(model, tokenizer, default model name) for the serve arguments (``--preset``,
    ``--checkpoint``, ``--seed``, ``--device``): with neither, the quickstart model, trained
    first if missing. ``--checkpoint`` is any :func:`hyla.model.load_model` source."""
    import torch

    from hyla.model.formats.checkpoint import CONFIG, latest_checkpoint
    from hyla.model.load import load_model as load_source
    from hyla.model.load import model_name

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
    return model, tok, model_name(path)


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
