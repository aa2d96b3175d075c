"""``hyla serve``: the OpenAI-compatible server (:mod:`hyla.serve.api`) under uvicorn, and
``hyla generate`` (sample text from a checkpoint or a random preset).

With neither ``--checkpoint`` nor ``--preset``, ``hyla serve`` serves the quickstart model
(``runs/quickstart``), training it first (a few minutes on a CPU) if it is not there.
Decode runs eagerly by default; ``--compile`` puts it through ``torch.compile`` (one graph
per decode batch width, built in the background after the server is up: a minute or more
on a CPU, where it makes a one-sequence decode step about 1.5x faster).

Example:
    $ hyla serve --preset debug --port 8000
    $ HYLA_API_KEY=secret hyla serve --checkpoint runs/quickstart --max-num-seqs 32
    $ hyla generate --preset debug --prompt "Hello" --max-tokens 32 --seed 0
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from rich.console import Console

from hyla.cli.common import (
    PRESETS_HELP,
    QUICKSTART_DIR,
    SOURCE_HELP,
    add_allow_nonfinite,
    add_sampling,
    add_speculative,
    format_bytes,
    generate_text,
    load_model,
    positive,
    positive_float,
    random_model,
    speed_line,
    torch_threads,
)
from hyla.cli.model_flags import (
    add_kv_cache_dtype,
    add_kv_cache_memory,
    add_quantize,
    add_weights_cache,
    apply_quantize,
    byte_size,
    draft_model,
    drafter,
    drafts_kept,
    load_quantized,
)


def add_generate(sub) -> argparse.ArgumentParser:
    """Register ``hyla generate`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("generate", help="sample text from a checkpoint or a random preset")
    p.add_argument("--preset", default=None,
                   help=f"random weights of this preset ({PRESETS_HELP}; testing)")
    p.add_argument("--checkpoint", default=None, help=SOURCE_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue (no chat template: "
                   "hyla chat applies the model's)")
    add_sampling(p, 64, None)
    add_speculative(p, "with --temperature 0")
    p.add_argument("--quiet", action="store_true",
                   help="no speed line on stderr (load time, prompt and decode tok/s)")
    add_allow_nonfinite(p)
    add_quantize(p)
    add_weights_cache(p)
    p.set_defaults(func=cmd_generate)
    return p


def add_serve(sub) -> argparse.ArgumentParser:
    """Register ``hyla serve`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, "
                                     "streaming, /metrics)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", default=None,
                     help=f"{SOURCE_HELP} (default: {QUICKSTART_DIR}, trained first if "
                          "missing)")
    src.add_argument("--preset", default=None,
                     help=f"random weights of this preset with the byte tokenizer "
                          f"({PRESETS_HELP}; testing)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--model-name", default=None,
                   help="the name clients pass as `model` (default: the checkpoint folder's "
                        "name, or hyla-<preset>)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY' on every route but /health, "
                        "KEY read from PATH (default: $HYLA_API_KEY, or no key). Never on "
                        "the command line: ps shows it to every user")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--header-timeout", type=positive_float, default=30.0,
                   help="seconds a connection has to send a request's headers, from its "
                        "opening or its previous response; then it is closed "
                        "(default: %(default)s)")
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request's body has to arrive after its headers (408 "
                        "and close after; default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=positive_float, default=5.0,
                   help="seconds an idle connection stays open between requests "
                        "(default: %(default)s)")
    p.add_argument("--max-connections", type=positive, default=1024,
                   help="open connections at most; one more gets a 503 and is closed "
                        "(default: %(default)s)")
    p.add_argument("--max-body-bytes", type=positive, default=4 << 20,
                   help="largest request body accepted (413 above; default 4 MiB)")
    p.add_argument("--max-num-seqs", type=positive, default=16,
                   help="sequences decoded together (state slots)")
    p.add_argument("--max-model-len", type=positive, default=2048,
                   help="prompt + completion tokens per request")
    p.add_argument("--max-num-batched-tokens", type=positive, default=1024,
                   help="tokens computed per engine step (prefill chunk budget)")
    p.add_argument("--max-waiting", type=positive, default=256,
                   help="queued requests before new ones get 429")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off the prefix cache (shared KV blocks, GLA state snapshots)")
    p.add_argument("--snapshot-interval", type=positive, default=256, metavar="TOKENS",
                   help="a long prompt's fixed-size states (GLA, delta rule, Mamba) are "
                        "snapshotted every TOKENS tokens, a multiple of 16, and at its last "
                        "full block (default: %(default)s)")
    p.add_argument("--prefix-cache-memory", type=byte_size, default=None, metavar="SIZE",
                   help="bytes for those snapshots (2G, 512MB, or a fraction of RAM), least "
                        "recently used evicted first (default: 8 per --max-num-seqs within 256 "
                        "MiB, at least one per sequence)")
    add_speculative(p, "mtp and draft:SOURCE for a request decoding alone; ngram for "
                       "several decoding together too, on a compiled model without "
                       "fixed-size state")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true",
                      help="torch.compile the decode step, one graph a batch width, built in "
                           "the background once the server is up (eager meanwhile; "
                           "default: eager)")
    mode.add_argument("--eager", action="store_true", help="eager decode (the default)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights and activations (recurrent states stay float32); auto: "
                        "bfloat16 on CUDA, as loaded elsewhere")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay each decode batch shape as a CUDA graph, all captured before "
                        "serving (CUDA only; with --compile, graphs of the compiled step)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="weights seed for --preset")
    p.add_argument("--log-level", default="info", help="uvicorn's log level",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_allow_nonfinite(p)
    add_quantize(p)
    add_weights_cache(p)
    add_kv_cache_memory(p)
    add_kv_cache_dtype(p)
    p.set_defaults(func=cmd_serve)
    return p


COMMANDS = {"generate": add_generate, "serve": add_serve}


def cmd_generate(args: argparse.Namespace, out: Console) -> int:
    if (args.preset is None) == (args.checkpoint is None):
        raise ValueError("generate needs exactly one of --preset P (random weights) or "
                         "--checkpoint SOURCE")
    import time

    from hyla.model.stream import StreamTiming

    start = time.perf_counter()
    if args.checkpoint is not None:
        from hyla.model.load import load_model as load_source
        from hyla.model.load import require_tokenizer

        def load():
            model, tok = load_source(args.checkpoint)
            return model, require_tokenizer(tok, args.checkpoint, "hyla generate")
        model, tok, _ = load_quantized(args, None, load)
    else:
        model, tok = random_model(args.preset, args.seed)
        apply_quantize(model, args)
    draft = drafter(args, model, tok, Console(stderr=True) if not args.quiet else None)
    load_s, timing = time.perf_counter() - start, StreamTiming()
    with torch_threads(args.threads):
        text = generate_text(model, tok, args.prompt, args, timing, draft)
    if args.checkpoint is None:
        out.print("[dim](random weights: the text is noise until a checkpoint is loaded)[/]")
    sys.stdout.write(args.prompt + text + "\n")
    sys.stdout.flush()
    if not args.quiet:
        Console(stderr=True, soft_wrap=True).print(
            f"[dim]{speed_line(load_s, timing)}{drafts_kept(args, draft)}[/]",
            highlight=False)
    return 0


def serve_dtype(choice: str, weight):
    """The serving dtype for ``--dtype``: auto is bfloat16 on CUDA, else the weights' own.

    Example:
        >>> import torch
        >>> serve_dtype("auto", torch.zeros(1)), serve_dtype("bfloat16", torch.zeros(1))
        (torch.float32, torch.bfloat16)
    """
    import torch

    if choice == "auto":
        return torch.bfloat16 if weight.device.type == "cuda" else weight.dtype
    return getattr(torch, choice)


def cmd_serve(args: argparse.Namespace, out: Console) -> int:
    import torch
    import uvicorn

    from hyla.serve.api.app import create_app
    from hyla.serve.async_engine import AsyncEngine
    from hyla.serve.engine import Engine, EngineConfig
    from hyla.serve.http_guard import ServerLimits, server_config

    if not 0 < args.port < 65536:
        raise ValueError(f"port must be in [1, 65535], got {args.port}")
    key = resolve_api_key(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from hyla.serve.memory_report import rss_bytes
    from hyla.serve.startup import StartupClock

    clock = StartupClock()
    rss_before_model = rss_bytes()
    model, tok, name = load_serving(args, out, clock)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=not args.no_prefix_caching,
                          snapshot_interval=args.snapshot_interval,
                          speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens,
                          prefix_cache_memory=args.prefix_cache_memory,
                          kv_cache_memory=args.kv_cache_memory,
                          kv_cache_dtype=args.kv_cache_dtype,
                          compile=args.compile, cuda_graphs=args.cuda_graphs,
                          eager_until_compiled=args.compile and not args.cuda_graphs)
    engine = Engine(model, tok, config, draft_model=draft_model(args, model, tok, out))
    if engine.kv_cache_bytes:
        blocks = engine.scheduler.config.num_kv_blocks
        dtype = str(engine.runner.kv_dtype).removeprefix("torch.")
        lazy = "; in memory as blocks fill" if engine.runner.device.type == "cpu" else ""
        out.print(f"KV cache: {blocks} blocks of {config.block_size} tokens in {dtype}, "
                  f"{format_bytes(engine.kv_cache_bytes)} reserved "
                  f"({blocks * config.block_size // args.max_model_len} full-length "
                  f"sequences{lazy})")
    if config.speculative:
        out.print(f"speculative decoding: {config.speculative}, up to "
                  f"{config.num_speculative_tokens} drafts a step"
                  + (" for a request decoding alone" if config.speculative != "ngram"
                     else ""))
    pc = engine.scheduler.prefix_cache
    if pc is not None and pc.num_snapshots:
        out.print(f"prefix cache: {pc.num_snapshots} state snapshots every "
                  f"{config.snapshot_interval} tokens, {format_bytes(engine.snapshot_bytes)}")
    dead: list[BaseException] = []
    server: list = []

    def on_dead(err: BaseException) -> None:
        # The engine failed past its restarts: exit non-zero so a supervisor restarts us.
        dead.append(err)
        if server:
            server[0].should_exit = True
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting, on_dead=on_dead)
    name = args.model_name or name
    limits = ServerLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          keep_alive_timeout=args.keep_alive_timeout,
                          max_connections=args.max_connections)
    ready = threading.Event()       # /health says "starting" and requests wait until set
    app = create_app(async_engine, model_name=name, api_key=key, body_timeout=limits.body_timeout,
                     max_body_bytes=args.max_body_bytes, ready=ready,
                     aliases=short_names(args.checkpoint))
    base = f"http://{args.host}:{args.port}"
    out.print(f"Serving [bold]{name}[/] on {base}/v1 (max {args.max_num_seqs} sequences, "
              f"context {args.max_model_len}, {'compiled' if args.compile else 'eager'} "
              f"decode on {next(model.parameters()).device}); metrics at {base}/metrics")
    server.append(uvicorn.Server(server_config(
        app, args.host, args.port, limits, log_level=args.log_level,
        timeout_graceful_shutdown=3)))
    clock.mark("the engine and server")
    threading.Thread(target=warm_up, args=(async_engine, args, out, ready, on_dead),
                     kwargs={"rss_before_model": rss_before_model, "clock": clock},
                     name="hyla-warmup", daemon=True).start()
    try:
        server[0].run()
    finally:
        async_engine.shutdown()
    if dead:
        out.print(f"[red]the engine failed for good: {dead[0]!r}[/]")
        return 1
    return 0


def short_names(checkpoint) -> tuple[str, ...]:
    """The packaged-model name the checkpoint was given by (``smollm2``), which requests may
    use beside the served name (``smollm2-135m-instruct``); none for a path.

    Example:
        >>> short_names("smollm2"), short_names("runs/small")
        (('smollm2',), ())
    """
    from hyla.model.names import lookup

    text = str(checkpoint)
    return (text,) if lookup(text) is not None else ()


def load_serving(args: argparse.Namespace, out: Console, clock):
    """(model, tokenizer, name) to serve: ``--checkpoint`` through the prepared-weights
    cache (:func:`~hyla.cli.model_flags.load_quantized`), else the preset or the quickstart
    model, in ``--dtype`` and quantised as ``--quantize`` says; ``clock``'s phases marked."""
    import torch

    if args.checkpoint is None:
        model, tok, name = load_model(args, out)
        clock.mark("loading")
        model = apply_quantize(model.to(serve_dtype(args.dtype, model.anchor)), args, out)
        clock.mark("quantising")
        return model, tok, name
    from hyla.model.load import model_name

    def load():
        model, tok, _ = load_model(args, out)
        clock.mark("loading")
        return model.to(serve_dtype(args.dtype, model.anchor)), tok

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok, hit = load_quantized(args, out, load, device=device, variant=args.dtype)
    clock.mark("reading prepared weights" if hit else "quantising")
    return model, tok, model_name(args.checkpoint)


def warm_up(async_engine, args: argparse.Namespace, out: Console, ready: threading.Event,
            on_failure, *, rss_before_model: int = 0, clock=None) -> None:
    """The server's warm-up, on its own thread while ``/health`` says "starting" (requests
    wait for ``ready``): with ``--cuda-graphs`` every decode shape captured, so no request
    waits on it; then one tiny request, so first-call costs (allocator, kernels) land on no
    client's time to first token. A failure ends the server (``on_failure``).

    Once ready, a quantised model's layers make the copies they would otherwise make on some
    request's first prompt (:func:`~hyla.model.quantize.prepare_copies`), and then, with
    ``--compile`` alone, each decode width's graph is built while the server serves that
    width eagerly (a minute or more on a CPU, while eager steps slow down as the two threads
    share the interpreter); ``/health`` lists the widths built. A width that fails to
    compile stays eager. In between, the resident memory's breakdown is logged
    (:mod:`hyla.serve.memory_report`; ``rss_before_model``: the resident set before the
    model was loaded), and with ``clock`` (a :class:`~hyla.serve.startup.StartupClock`),
    where the start-up's time went."""
    import asyncio

    from hyla.serve.metrics import EngineMetrics
    from hyla.serve.sequence import SamplingParams

    engine = async_engine.engine

    async def tiny() -> None:
        async for _ in async_engine.generate([0], SamplingParams(max_tokens=2, temperature=0)):
            pass
    try:
        if args.cuda_graphs:
            # on the runner only (padding slot and block): no request is in the engine yet
            built = engine.warmup()
            out.print(f"compiled {built} decode graphs, captured {engine.runner.num_captures} "
                      f"CUDA graphs")
        asyncio.run(tiny())             # through the engine thread, as every request
        async_engine.metrics = EngineMetrics()      # the warm-up was no client's request
    except BaseException as e:  # noqa: BLE001 - the server cannot serve: it exits
        on_failure(e)
        return
    ready.set()
    if clock is not None:
        clock.mark("warm-up")
        out.print(clock.describe())
    if getattr(engine.model, "quantized", None):
        # the quantised layers' other copies (about a second), once the server is ready
        from hyla.model.quantize import prepare_copies

        prepare_copies(engine.model)       # before compiling: the graphs read them
    from hyla.serve.memory_report import (
        breakdown,
        describe,
        describe_groups,
        group_bytes,
        rss_bytes,
    )

    out.print(describe(breakdown(engine, rss_before_model)))
    out.print(describe_groups(group_bytes(engine)))
    if args.compile and not args.cuda_graphs:
        began, resident = time.perf_counter(), rss_bytes()
        try:
            # the padding slot and block only: requests run beside it, eagerly
            built = engine.warmup()
        except Exception as e:  # noqa: BLE001 - the widths not built stay eager
            engine.runner.compile_error = repr(e)[:500]
            out.print(f"[yellow]compiling decode failed ({e!r}); widths "
                      f"{sorted(engine.runner.built_widths)} compiled, the others eager[/]")
            return
        # what compiling freed (graphs traced and lowered, code generated): glibc keeps it
        # otherwise (hyla.perf.tune_cpu_allocator)
        import gc

        from hyla.perf import release_freed_memory

        gc.collect()
        release_freed_memory()
        now = rss_bytes()
        # the compiler's share of the resident set: its libraries (torch._inductor and what it
        # imports) and the graphs' code and metadata (SmolLM2's 5 widths: about 330 MB)
        out.print(f"compiled {built} decode graphs in {time.perf_counter() - began:.0f} s; "
                  f"{now / 2**20:.0f} MB resident, {(now - resident) / 2**20:+.0f} MB since the "
                  f"breakdown (the compiler, its graphs, and requests served meanwhile)")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key-file`` or ``$HYLA_API_KEY``; a key given on the command
    line is refused (every user of the machine sees it in ``ps``)."""
    from hyla.disagg.live.auth import api_key

    if getattr(args, "api_key", None):
        raise ValueError("--api-key on the command line is visible to every user in ps: put "
                         "the key in $HYLA_API_KEY or a file named by --api-key-file")
    return api_key(args.api_key_file)
