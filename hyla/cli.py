"""``hyla <command>``: each command is a thin call into a package function.

Commands here: ``memory`` (state vs KV cache), ``generate`` (sample text), ``quickstart``
(state accounting, a short training run, a sample), ``info`` (versions, device, matmul peak).
Groups in their own modules: ``train``/``plot``/``tokenizer`` (:mod:`hyla.cli_train`),
``eval recall|needle|ppl`` (:mod:`hyla.cli_eval`), ``bench`` (:mod:`hyla.cli_bench`),
``serve`` (:mod:`hyla.cli_serve`).

Example:
    $ hyla memory --preset laplace-3b --context 8K --budget-gib 80
    $ hyla memory --preset laplace-3b --context 8192 --json
    $ hyla generate --preset debug --prompt "Hello" --max-tokens 32 --seed 0
    $ hyla eval recall --preset quick --out benchmarks/results/recall_quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hyla.perf import tune_cpu_allocator

DEFAULT_BUDGET_GIB = 80.0  # one 80 GB accelerator: the usual unit of a serving replica


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits by itself; we want one error path for all bad input.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgumentError(f"{self.prog}: {message}")


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


def _memory_table(report: dict) -> Table:
    name = report["preset"] or "config"
    kv = "bf16" if report["kv_dtype"] == "bfloat16" else report["kv_dtype"]
    table = Table(title=f"Per-sequence memory of {name} at {report['context']:,} tokens")
    table.add_column("")
    table.add_column("hybrid", justify="right")
    table.add_column("all-attention", justify="right")
    br, layers = report["state_breakdown"], report["layers"]
    n = layers["gla"] + layers["attention"]
    table.add_row("layers", f"{layers['gla']} GLA + {layers['attention']} attention",
                  f"{n} attention")
    table.add_row("GLA state (fp32)", format_bytes(br["gla"]), "-")
    table.add_row(f"attention KV ({kv})", format_bytes(br["attention"]),
                  format_bytes(report["kv_bytes"]))
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


def _published_line(report: dict) -> str | None:
    pub = report.get("published")
    if not pub:
        return None
    return (f"Published for this model: {format_bytes(pub['state_bytes'])} of state, "
            f"~{pub['ratio']:.0f}x less than the KV cache; this config gives "
            f"{format_bytes(report['state_bytes'])}, {report['ratio']:.1f}x.")


def cmd_memory(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import memory_report

    report = memory_report(args.preset, args.context, budget_gib=args.budget_gib)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    out.print(_memory_table(report))
    line = _published_line(report)
    if line:
        out.print(line)
    return 0


@contextlib.contextmanager
def _threads(n: int | None):
    """Use ``n`` torch threads inside the block (restored after: main() may run in-process)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _random_model(preset_name: str, seed: int | None):
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


def _generate_text(model, tok, prompt: str, args: argparse.Namespace) -> str:
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
    with torch.inference_mode():
        new = generate(model, tok.encode(prompt), args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed)
    return tok.decode(new)


def cmd_generate(args: argparse.Namespace, out: Console) -> int:
    if (args.preset is None) == (args.checkpoint is None):
        raise ValueError("generate needs exactly one of --preset P (random weights) or "
                         "--checkpoint DIR")
    if args.checkpoint is not None:
        from hyla.model.checkpoint import load_checkpoint

        model, tok = load_checkpoint(args.checkpoint)
    else:
        model, tok = _random_model(args.preset, args.seed)
    with _threads(args.threads):
        text = _generate_text(model, tok, args.prompt, args)
    if args.checkpoint is None:
        out.print("[dim](random weights: the text is noise until a checkpoint is loaded)[/]")
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def train_quickstart(out: Console, *, preset: str = "small", steps: int = 120,
                     out_dir: str = "runs/quickstart") -> str:
    """Train the quickstart model (a BPE tokenizer, then ``steps`` AdamW steps on the Python
    standard library's source) into ``out_dir``; returns ``out_dir``. ``hyla quickstart``
    and ``hyla serve`` (with no checkpoint) both call it."""
    from hyla.train.config import TrainConfig
    from hyla.train.trainer import Trainer

    # AdamW here: at a CPU-sized batch Muon's Newton-Schulz costs more than the model itself.
    cfg = TrainConfig(preset=preset, steps=steps, seq_len=256, batch_size=4,
                      optimizer="adamw", lr=3e-3, warmup_steps=min(5, steps),
                      save_every=steps, eval_batches=4, out=out_dir)
    out.print(f"Training [bold]{cfg.preset}[/] for {cfg.steps} steps of "
              f"{cfg.tokens_per_step:,} tokens on the Python standard library's source "
              f"(a byte-level BPE of {cfg.vocab_size:,} tokens is trained first):")
    record = Trainer(cfg).fit()
    out.print(f"validation loss [bold]{record['val_loss']:.3f}[/] nats/token after "
              f"{record['tokens']:,} tokens; checkpoint in {cfg.out} "
              f"(hyla generate --checkpoint {cfg.out} --prompt ...)")
    return cfg.out


def serve_hint(checkpoint: str, name: str, port: int = 8000) -> str:
    """What to run to serve ``checkpoint`` and query it with curl and the openai client.

    Example:
        >>> "hyla serve --checkpoint runs/q" in serve_hint("runs/q", "q")
        True
    """
    base = f"http://127.0.0.1:{port}/v1"
    body = json.dumps({"model": name, "prompt": "def fibonacci(n):", "max_tokens": 32})
    return (f"Serve it (OpenAI-compatible API on 127.0.0.1:{port}):\n"
            f"  hyla serve --checkpoint {checkpoint}\n"
            f"Then, from another shell:\n"
            f"  curl {base}/completions -H 'Content-Type: application/json' -d '{body}'\n"
            f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}', "
            f"api_key='none'); print(c.completions.create(model='{name}', "
            f"prompt='def fibonacci(n):', max_tokens=32).choices[0].text)\"")


def cmd_quickstart(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import memory_report

    out.rule("hyla quickstart")
    small = memory_report("small", 8192, budget_gib=DEFAULT_BUDGET_GIB)
    out.print(f"Preset [bold]small[/]: layers {small['layers']}, "
              f"{small['params']:,} parameters.")
    out.print(_memory_table(small))
    big = memory_report("laplace-3b", 8192, budget_gib=DEFAULT_BUDGET_GIB)
    out.print(f"Preset [bold]laplace-3b[/] (all GLA, {big['params'] / 1e9:.2f}B parameters) at "
              f"8K tokens: {format_bytes(big['state_bytes'])} of state per sequence vs "
              f"{format_bytes(big['kv_bytes'])} of bf16 KV cache: {big['ratio']:.0f}x less.")
    line = _published_line(big)
    if line:
        out.print(line)
    from hyla.model.checkpoint import load_checkpoint

    ckpt = train_quickstart(out, preset=args.preset, steps=args.steps, out_dir=args.out)
    model, tok = load_checkpoint(ckpt)
    prompt = "def fibonacci(n):\n    "
    with _threads(args.threads):
        text = _generate_text(model, tok, prompt, args)
    out.print("A sampled completion of a Python prompt:")
    out.print(prompt + text, markup=False, highlight=False)
    import pathlib

    out.print(serve_hint(ckpt, pathlib.Path(ckpt).resolve().name), markup=False,
              highlight=False, soft_wrap=True)     # no wrapping: the lines are to copy
    return 0


def cmd_info(args: argparse.Namespace, out: Console) -> int:
    import torch

    from hyla.perf import machine_info, matmul_peak_flops

    info = machine_info()
    cuda = info["cuda_device"] is not None
    device = "cuda" if cuda else "cpu"
    table = Table(title="hyla info")
    table.add_column("")
    table.add_column("")
    from hyla import __version__

    table.add_row("hyla", __version__)
    for key, value in info.items():
        table.add_row(key, str(value))
    table.add_row("device", device)
    # Small sizes on CPU: bf16 matmul is slow on CPUs without native bf16 units.
    for dtype, size in ((torch.float32, 4096 if cuda else 1024),
                        (torch.bfloat16, 4096 if cuda else 512)):
        flops = matmul_peak_flops(dtype, size=size, repeats=3, device=device)
        table.add_row(f"matmul peak {str(dtype).removeprefix('torch.')} ({size}^3)",
                      f"{flops / 1e9:,.1f} GFLOP/s")
    out.print(table)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    """The ``hyla`` argument parser (one sub-command per package entry point)."""
    from hyla.eval.memory import parse_context

    def context(value: str) -> int:
        try:
            return parse_context(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser = _Parser(prog="hyla", description="Hybrid linear-attention language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("memory", help="per-sequence state of a hybrid vs an all-attention KV cache")
    p.add_argument("--preset", required=True, help="debug, small, laplace-3b")
    p.add_argument("--context", required=True, type=context, help="tokens, e.g. 8192 or 8K")
    p.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET_GIB,
                   help=f"memory for weights + states (default {DEFAULT_BUDGET_GIB:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_memory)

    def add_sampling(p: argparse.ArgumentParser, max_tokens: int, threads: int | None) -> None:
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
        p.add_argument("--top-k", type=int, default=None)
        p.add_argument("--seed", type=int, default=0)
        # One-token decode of a small model is latency bound: extra threads mostly add
        # synchronisation, and on a busy machine they can cost 10x.
        p.add_argument("--threads", type=positive, default=threads,
                       help="torch CPU threads (default: "
                            f"{'torch' + chr(39) + 's choice' if threads is None else threads})")

    p = sub.add_parser("generate", help="sample text from a checkpoint or a random preset")
    p.add_argument("--preset", default=None, help="random weights of this preset")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory")
    p.add_argument("--prompt", required=True)
    add_sampling(p, 64, None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("quickstart", help="state accounting, a short training run, a sample")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=positive, default=120)
    p.add_argument("--out", default="runs/quickstart")
    add_sampling(p, 48, 1)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("info", help="versions, device, measured matmul peak")
    p.set_defaults(func=cmd_info)

    # Command groups with their own modules (imported here: they import from this one).
    from hyla.cli_bench import add_bench_commands
    from hyla.cli_disagg import add_disagg_commands
    from hyla.cli_distill import add_distill_commands
    from hyla.cli_eval import add_eval_commands
    from hyla.cli_serve import add_serve_commands
    from hyla.cli_train import add_train_commands

    add_bench_commands(sub)
    add_disagg_commands(sub)
    add_distill_commands(sub)
    add_eval_commands(sub)
    add_serve_commands(sub)
    add_train_commands(sub)
    from hyla.cli_cluster import add_cluster_commands  # after serve: adds its --role options

    add_cluster_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hyla`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> main(["memory", "--preset", "debug", "--context", "1K", "--json"])  # doctest: +SKIP
        0
    """
    err = Console(stderr=True)
    tune_cpu_allocator()  # a CLI run owns its process: keep freed memory for reuse
    try:
        args = build_parser().parse_args(argv)
        return args.func(args, Console())
    except (_ArgumentError, ValueError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    except ModuleNotFoundError as e:  # an optional extra the command needs
        err.print("[red]error:[/] " + escape(f"{e}: this command needs an optional extra, e.g. "
                                             "pip install -e '.[serve]' (serving, cluster, "
                                             "simulate) or '.[hf]'"))
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
