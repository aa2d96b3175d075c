"""``hyla cluster`` and ``hyla serve --role prefill|decode|router`` (Prefill-as-a-Service).

Example:
    $ hyla cluster --preset debug --port 8000 --link-gbps 1     # all roles on this machine
    $ hyla serve --role prefill --preset debug --port 8101 --link-gbps 10
    $ hyla serve --role decode --preset debug --port 8201
    $ hyla serve --role router --preset debug --port 8000 \\
          --prefill-workers http://127.0.0.1:8101 --decode-workers http://127.0.0.1:8201
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import threading
import time

from rich.console import Console

from hyla.cli.common import (
    PRESETS_HELP,
    QUICKSTART_DIR,
    SOURCE_HELP,
    load_model,
    positive,
    positive_float,
)


def _urls(value: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not all(u.startswith(("http://", "https://")) for u in urls):
        raise argparse.ArgumentTypeError(f"expected comma-separated http:// URLs, got {value!r}")
    return urls


def add_cluster(sub) -> argparse.ArgumentParser:
    """Register ``hyla cluster`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("cluster", help="router + remote prefill pool + local PD pool on this "
                                       "machine (Prefill-as-a-Service, one process a worker)")
    p.add_argument("--config", default=None, help="cluster.toml (the flags override it)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help=f"random weights of this preset ({PRESETS_HELP}; testing)")
    src.add_argument("--checkpoint", default=None, help=f"{SOURCE_HELP} (default: "
                     "runs/quickstart, trained first if missing)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="the router's port (default 8000)")
    p.add_argument("--prefill-workers", type=int, default=None,
                   help="remote prefill pool size (default 1)")
    p.add_argument("--decode-workers", type=positive, default=None,
                   help="local PD pool size (default 2)")
    p.add_argument("--link-gbps", type=positive_float, default=None,
                   help="the prefill -> decode link's expected Gbps: the router's initial "
                        "estimate (it measures the real link from every transfer) and the "
                        "prefill workers' pacing cap (default 10)")
    p.add_argument("--threshold", type=positive, default=None,
                   help="initial routing threshold in incremental prompt tokens (default 1024)")
    p.add_argument("--transfer-timeout", type=float, default=None,
                   help="the longest a shipped state may take, in seconds; each transfer's "
                        "own deadline comes from the measured link and the state's size "
                        "(default 30)")
    p.add_argument("--max-num-seqs", type=positive, default=None,
                   help="sequences a worker decodes together (default 16)")
    p.add_argument("--max-model-len", type=positive, default=None,
                   help="prompt + completion tokens a request (default 2048)")
    p.add_argument("--threads", type=positive, default=None, help="torch threads per worker "
                   "(default 1)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="the API key clients must send, read from PATH (default: "
                        "$HYLA_API_KEY, or none); the workers get it through their "
                        "environment, never their command lines")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-dir", default=None, help="workers' logs (default: a temp folder)")
    p.set_defaults(func=cmd_cluster)
    return p


COMMANDS = {"cluster": add_cluster}


def add_role_options(serve: argparse.ArgumentParser) -> None:
    """Give ``hyla serve`` (the parser of :func:`hyla.cli.serve.add_serve`) its ``--role``
    options: with ``--role``, it runs that role (:func:`cmd_role`) instead of a plain
    server."""
    g = serve.add_argument_group("Prefill-as-a-Service roles (hyla.disagg)")
    g.add_argument("--role", choices=("prefill", "decode", "router"), default=None,
                   help="run one role of a disaggregated cluster instead of a plain server")
    g.add_argument("--prefill-workers", type=_urls, default=[],
                   help="router: prefill workers' URLs, comma-separated")
    g.add_argument("--decode-workers", type=_urls, default=[],
                   help="router: decode (PD) workers' URLs, comma-separated")
    g.add_argument("--link-gbps", type=positive_float, default=None,
                   help="prefill: pace state transfers to at most this rate (default: "
                        "unpaced); router: the initial link estimate, replaced by what "
                        "transfers measure (default 10)")
    g.add_argument("--threshold", type=positive, default=1024,
                   help="router: initial threshold t (incremental prompt tokens)")
    g.add_argument("--static-threshold", action="store_true",
                   help="router: keep t fixed (no short-timescale control)")
    g.add_argument("--force-path", choices=("local", "remote"), default=None,
                   help="router: send every request this way (benchmarks)")
    g.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="decode/router: the longest wait for a shipped state, in seconds; "
                        "the router gives each transfer a shorter deadline from its link "
                        "estimate (default: %(default)s)")
    g.add_argument("--transfer-port", type=int, default=0,
                   help="decode: TCP port of the state receiver (default: a free one)")
    g.add_argument("--advertise-host", default=None,
                   help="decode: host name prefill workers reach this worker by "
                        "(default: --host)")
    plain = serve.get_default("func")
    serve.set_defaults(func=lambda args, out: cmd_role(args, out) if args.role
                       else plain(args, out))


def _watch_parent() -> None:
    """A worker started by ``hyla cluster`` exits when the cluster process is gone."""
    parent = os.environ.get("HYLA_CLUSTER_PARENT")
    if not parent:
        return

    def watch():
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def _tokenizer_and_name(args):
    from hyla.data.tokenizer import ByteTokenizer
    from hyla.model.load import load_tokenizer, model_name

    if args.preset is not None:
        return ByteTokenizer(), f"hyla-{args.preset}"
    path = args.checkpoint or QUICKSTART_DIR
    return load_tokenizer(path), model_name(path)


def cmd_role(args: argparse.Namespace, out: Console) -> int:
    import uvicorn

    from hyla.cli.serve import resolve_api_key
    from hyla.disagg.live.auth import cluster_secret, internal_http_key, worker_transfer_key
    from hyla.serve.http_guard import ServerLimits, server_config

    if not 0 < args.port < 65536:
        raise ValueError(f"port must be in [1, 65535], got {args.port}")
    key = resolve_api_key(args)
    _watch_parent()
    # The same header, keep-alive and connection limits as hyla serve (hyla serve's flags).
    limits = ServerLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          keep_alive_timeout=args.keep_alive_timeout,
                          max_connections=args.max_connections)

    def serve_app(app) -> uvicorn.Server:
        return uvicorn.Server(server_config(app, args.host, args.port, limits,
                                            log_level=args.log_level,
                                            timeout_graceful_shutdown=3))
    if args.role == "router":
        from hyla.disagg.live.router.app import create_router_app

        if args.speculative:
            out.print(f"--speculative {args.speculative}: not used by --role router (give "
                      f"it to the decode workers)")
        from hyla.disagg.live.router.core import LiveRouter, LiveRouterConfig, live_policy

        if not args.decode_workers:
            raise ValueError("--role router needs --decode-workers URL[,URL...]")
        tok, name = _tokenizer_and_name(args)
        cfg = LiveRouterConfig(prefill_urls=args.prefill_workers,
                               decode_urls=args.decode_workers,
                               model_name=args.model_name or name,
                               max_model_len=args.max_model_len,
                               policy=live_policy(threshold=args.threshold,
                                                  link_gbps=args.link_gbps or 10.0,
                                                  adapt=not args.static_threshold),
                               transfer_timeout_s=args.transfer_timeout,
                               api_key=key, force=args.force_path,
                               cluster_secret=cluster_secret(),
                               # a PD worker keeps max_num_seqs GLA snapshots (engine default)
                               prefix_capacity=args.max_num_seqs or 16)
        out.print(f"Router for [bold]{cfg.model_name}[/] on http://{args.host}:{args.port}/v1: "
                  f"{len(cfg.prefill_urls)} prefill, {len(cfg.decode_urls)} decode workers")
        serve_app(create_router_app(LiveRouter(cfg, tok), max_body_bytes=args.max_body_bytes)
                  ).run()
        return 0

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tok, name = load_model(args, out)
    if args.role == "prefill" and args.speculative:
        out.print(f"--speculative {args.speculative}: not used by --role prefill (it only "
                  f"prefills; give it to the decode workers)")
    if args.role == "prefill":
        from hyla.disagg.live.worker.prefill import PrefillService, create_prefill_app

        # It ships states only to the decode workers the router registers (none until then).
        svc = PrefillService(model, tokenizer=tok, max_model_len=args.max_model_len,
                             chunk_tokens=args.max_num_batched_tokens,
                             link_gbps=args.link_gbps,
                             key=worker_transfer_key(key, args.host), allowed=set())
        out.print(f"Prefill worker on http://{args.host}:{args.port} (link "
                  f"{args.link_gbps or 'unlimited'} Gbps, fingerprint {svc.fingerprint})")
        try:
            serve_app(create_prefill_app(svc, key, internal_http_key())).run()
        finally:
            svc.close()
        return 0

    from hyla.cli.model_flags import draft_model
    from hyla.disagg.live.worker.decode import build_decode_worker
    from hyla.serve.engine import EngineConfig

    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=not args.no_prefix_caching,
                          compile=args.compile, speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens)
    dead: list = []
    server: list = []

    def on_dead(err):
        # The engine failed past its restarts: exit non-zero so a supervisor can restart us.
        dead.append(err)
        if server:
            server[0].should_exit = True
    app, engine, rx = build_decode_worker(
        model, tok, args.model_name or name, config, max_waiting=args.max_waiting,
        api_key=key, transfer_bind=f"tcp://{args.host}:{args.transfer_port}",
        advertise_host=args.advertise_host, stall_s=max(args.transfer_timeout, 1.0),
        transfer_key=worker_transfer_key(key, args.host), on_dead=on_dead,
        internal_key=internal_http_key(), draft_model=draft_model(args, model, tok, out))
    out.print(f"Decode worker on http://{args.host}:{args.port} (state transfers on "
              f"{rx.address}, {'HMAC-authenticated' if rx.key else 'unauthenticated'})")
    server.append(serve_app(app))
    try:
        server[0].run()
    finally:
        engine.shutdown()
        rx.close()
    return 1 if dead else 0


def cmd_cluster(args: argparse.Namespace, out: Console) -> int:
    from hyla.cli.serve import resolve_api_key
    from hyla.disagg.live.cluster import launch, load_spec

    spec = load_spec(args.config, preset=args.preset, checkpoint=args.checkpoint,
                     host=args.host, port=args.port, prefill_workers=args.prefill_workers,
                     decode_workers=args.decode_workers, link_gbps=args.link_gbps,
                     threshold=args.threshold, transfer_timeout=args.transfer_timeout,
                     max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                     threads=args.threads, api_key=resolve_api_key(args),
                     log_dir=args.log_dir)
    if spec.preset is None and spec.checkpoint is None:
        from hyla.cli.common import train_quickstart
        from hyla.model.formats.checkpoint import CONFIG, latest_checkpoint

        if not (latest_checkpoint(pathlib.Path(QUICKSTART_DIR)) / CONFIG).is_file():
            out.print(f"No checkpoint in {QUICKSTART_DIR}: training the quickstart model first.")
            train_quickstart(out)
        spec.checkpoint = QUICKSTART_DIR
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    out.print(f"Starting {spec.prefill_workers} prefill and {spec.decode_workers} decode "
              f"workers and a router (logs in {spec.log_dir or 'a temp folder'}) ...")
    cluster = launch(spec)
    try:
        for p in cluster.procs:
            out.print(f"  {p.role:8s} {p.url}  pid {p.popen.pid}  log {p.log}")
        out.print(f"Serving on [bold]{cluster.url}/v1[/] (OpenAI API); workers, policy and "
                  f"routing at {cluster.url}/cluster. Ctrl-C stops everything.")
        reported = set()
        while True:
            for p in cluster.procs:
                code = p.popen.poll()
                if code is not None and p.popen.pid not in reported:
                    reported.add(p.popen.pid)
                    if p.role == "router":
                        out.print(f"[red]the router exited ({code})[/]:\n{p.log}")
                        return 1
                    out.print(f"[yellow]{p.role} worker {p.url} (pid {p.popen.pid}) exited "
                              f"with {code}; the router routes around it[/]")
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
