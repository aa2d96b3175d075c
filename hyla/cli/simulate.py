"""``hyla simulate`` (Prefill-as-a-Service simulator), ``hyla profile`` (an engine's
measured step costs, for the simulator) and ``hyla kv-table``.

Example:
    $ hyla simulate --setup published --rate 2 --json out.json
    $ hyla simulate --setup published --seeds 5          # capacities, 95% intervals
    $ hyla simulate --trace azure-conv --length-scale 8 --rate 1.5   # or --trace PATH.csv
    $ hyla simulate --list-traces                        # the built-in traces
    $ hyla profile --preset small --json cpu.json        # this machine's engine
    $ hyla simulate --profile cpu.json --rate 0.5        # every instance a process like it
    $ hyla simulate --model path/to/Kimi-Linear-48B-A3B --seeds 1   # that architecture
    $ hyla kv-table
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from rich.console import Console
from rich.table import Table

from hyla.cli.common import PRESETS_HELP, positive_float


def add_simulate(sub) -> argparse.ArgumentParser:
    """Register ``hyla simulate`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("simulate", help="simulate homogeneous PD, naive heterogeneous and "
                       "Prefill-as-a-Service deployments (SimPy)")
    p.add_argument("--setup", default="published", choices=("published",),
                   help="hardware and model of the published case study (default)")
    p.add_argument("--trace", default=None, metavar="NAME|CSV",
                   help="request trace (replaces the workload): a built-in name "
                        "(azure-conv, arxiv-summarization) or a CSV path")
    p.add_argument("--list-traces", action="store_true",
                   help="list the built-in traces with their length percentiles, and exit")
    p.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply the trace's prompt lengths (say so in reports)")
    p.add_argument("--output-scale", type=positive_float, default=1.0,
                   help="multiply the trace's output lengths")
    p.add_argument("--rate", type=positive_float, default=None,
                   help="requests/s; default: search each deployment's capacity under the SLOs")
    p.add_argument("--arrivals", default=None, choices=("trace", "poisson", "gamma"),
                   help="arrival process (default: trace timestamps if any, else poisson)")
    p.add_argument("--cv", type=positive_float, default=2.0, help="gamma arrivals' CV")
    p.add_argument("--requests", type=int, default=1600,
                   help="requests a run, at least (default 1,600: with --seeds 5 the published "
                        "setup's ratios come within +-5%% at 95%%; a 5-seed search takes about "
                        "40 minutes of one core. A quick look: --requests 400 --seeds 1 "
                        "--min-duration 0, about 2 minutes; a fixed --rate runs once, in "
                        "seconds)")
    p.add_argument("--min-duration", type=float, default=480.0, metavar="S",
                   help="capacity search: a run has at least rate * S requests, so that its "
                        "queues reach steady state (default 480 s)")
    p.add_argument("--screen-requests", type=int, default=0, metavar="N",
                   help="capacity search: when below --requests, first screen every "
                        "configuration on runs of N requests (the same first ones), then "
                        "search the 3 best of each family on full runs (default 0: every "
                        "configuration on full runs; a screen of 400 missed the best "
                        "threshold on one of 5 published-setup seeds)")
    p.add_argument("--seeds", type=int, default=5,
                   help="capacity search: workload seeds (lengths, arrivals, trace window); "
                        "capacities and ratios are means with 95%% intervals (default 5)")
    p.add_argument("--no-search", action="store_true",
                   help="capacity search: take --threshold, --homo-prefill and "
                        "--prfaas-prefill as they are (no long-timescale search)")
    p.add_argument("--offload", default="0.1,0.25,0.5,0.75", metavar="F,F,...",
                   help="capacity search: besides t = 0 and t = inf, the thresholds that "
                        "offload these fractions of the requests (default 0.1,0.25,0.5,0.75)")
    p.add_argument("--rel-tol", type=positive_float, default=0.02,
                   help="capacity bisection stops at hi/lo <= 1 + this (default 0.02)")
    p.add_argument("--deployments", default="homogeneous,naive,prfaas",
                   help="comma-separated, of homogeneous (PD on one cluster), naive "
                        "(heterogeneous: every prefill remote) and prfaas (long prompts remote)")
    p.add_argument("--threshold", type=int, default=19_400,
                   help="PrfaaS t at a fixed --rate or with --no-search; otherwise the "
                        "'configured' alternative (tokens)")
    p.add_argument("--static-threshold", action="store_true", help="do not adapt t")
    p.add_argument("--homo-prefill", type=int, default=11,
                   help="prefill instances of the 12 in homogeneous PD (default: grid's best)")
    p.add_argument("--prfaas-prefill", type=int, default=3,
                   help="local prefill instances of the 8 in PrfaaS (default: grid's best)")
    p.add_argument("--link-gbps", type=positive_float, default=100.0,
                   help="the inter-cluster link's bandwidth, Gbps")
    p.add_argument("--h200-mfu", type=positive_float, default=0.45,
                   help="achieved prefill MFU of the H200 cluster (default 0.45, as the H20s; "
                        "--fit-h200-mfu fits it to a published ratio, see docs/prfaas.md)")
    p.add_argument("--fit-h200-mfu", type=positive_float, default=None, metavar="RATIO",
                   help="capacity search: first fit the H200 MFU so that naive heterogeneous "
                        "serves RATIO times homogeneous PD at its best split (mean over the "
                        "seeds; the published ratio is 1.16), then compare at it")
    p.add_argument("--profile", default=None, metavar="JSON",
                   help="a measured profile (hyla profile): every instance, local and remote, "
                        "is then one engine process like the profiled one, serving its preset")
    p.add_argument("--model", default=None, metavar="DIR|CONFIG.json",
                   help="simulate this architecture instead of the case study's 1T hybrid: a "
                        "model directory (hyla, transformers, fla) or its config.json; state "
                        "and KV bytes from its StateSpecs, prefill FLOPs from its active "
                        "parameters (no weights are read)")
    p.add_argument("--weight-bits", type=positive_float, default=16.0,
                   help="with --model: bits a served weight takes (default 16, bf16; the case "
                        "study's 1T model is served in 4)")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    p.set_defaults(func=cmd_simulate)
    return p


def add_profile(sub) -> argparse.ArgumentParser:
    """Register ``hyla profile`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("profile", help="measure this machine's engine step costs (prefill "
                       "fixed cost and speed, decode by width and context) for hyla simulate")
    p.add_argument("--preset", default="debug",
                   help=f"model preset, random weights ({PRESETS_HELP})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--json", required=True, metavar="OUT",
                   help="where to write the profile (what hyla simulate --profile reads)")
    p.set_defaults(func=cmd_profile)
    return p


def add_kv_table(sub) -> argparse.ArgumentParser:
    """Register ``hyla kv-table`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("kv-table", help="Gbps of state/KV a prefill instance emits at 32K "
                       "tokens: dense vs 3:1 vs 7:1 hybrids")
    p.add_argument("--tokens", type=int, default=32_768,
                   help="prompt length the rates are computed at")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the table as JSON to OUT (default: table only)")
    p.set_defaults(func=cmd_kv_table)
    return p


COMMANDS = {"simulate": add_simulate, "profile": add_profile, "kv-table": add_kv_table}


def run_simulate(args: argparse.Namespace, progress=None) -> dict:
    from hyla.disagg.sim.hardware import published_1t_hybrid
    from hyla.disagg.sim.model import SimConfig
    from hyla.disagg.sim.setups import (
        PUBLISHED_INPUTS,
        compare,
        published_deployments,
        with_rate_range,
        workload_maker,
    )
    from hyla.disagg.sim.traces import trace_path

    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    if args.threshold < 1:      # before the deployments, which would name it otherwise
        raise ValueError(f"--threshold must be >= 1 token, got {args.threshold}")
    deps = published_deployments(homo_prefill=args.homo_prefill,
                                 prfaas_prefill=args.prfaas_prefill,
                                 threshold=args.threshold, adapt=not args.static_threshold,
                                 remote_mfu=args.h200_mfu)
    if args.h200_mfu > 1:
        raise ValueError(f"--h200-mfu must be in (0, 1], got {args.h200_mfu}")
    bad = [n for n in names if n not in deps]
    if bad or not names:
        raise ValueError(f"--deployments must be a comma list of {sorted(deps)}, got "
                         f"{args.deployments!r}")
    if args.requests < 10:
        raise ValueError(f"--requests must be >= 10, got {args.requests}")
    if args.trace is not None:
        try:
            trace_path(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace: {e}") from None
    arrivals = args.arrivals or ("trace" if args.trace else "poisson")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    try:
        fractions = tuple(float(x) for x in args.offload.split(",") if x.strip())
    except ValueError:
        fractions = ()
    if not fractions or not all(0 < f < 1 for f in fractions):
        raise ValueError(f"--offload must be a comma list of fractions in (0, 1), got "
                         f"{args.offload!r}")
    if args.min_duration < 0:
        raise ValueError(f"--min-duration must be >= 0 s, got {args.min_duration}")

    if args.screen_requests and args.screen_requests < 10:
        raise ValueError(f"--screen-requests must be 0 or >= 10, got {args.screen_requests}")
    screening = 0 < args.screen_requests < args.requests

    def make_seed(seed, min_duration=args.min_duration, n=args.requests):
        return workload_maker(trace=args.trace, length_scale=args.length_scale,
                              output_scale=args.output_scale, arrivals=arrivals, cv=args.cv,
                              num_requests=n, seed=seed,
                              min_duration_s=min_duration * n / args.requests)

    def screen_seed(seed):
        return make_seed(seed, n=args.screen_requests)
    make = make_seed(args.seed, 0.0)
    model = published_1t_hybrid()
    deps = {n: deps[n] for n in names}
    if args.model is not None:
        if args.profile is not None:
            raise ValueError("--model and --profile exclude each other: a measured profile "
                             "serves its own preset")
        model = model_spec(args.model, args.weight_bits, deps)
    if args.profile is not None:
        model, deps = _measured(args.profile, deps)
    cfg = SimConfig(link_gbps=args.link_gbps)
    if args.model is not None:
        cfg.kv_blocks = block_cap(model, deps, cfg, args.length_scale)
    calibration = None
    if args.fit_h200_mfu is not None:
        if args.rate is not None or args.profile is not None or \
                not {"homogeneous", "naive"} <= set(names):
            raise ValueError("--fit-h200-mfu needs the capacity search (no --rate, no "
                             "--profile) and the homogeneous and naive deployments")
        from hyla.disagg.sim.capacity import fit_remote_mfu, with_remote_mfu

        calibration = fit_remote_mfu(model, deps, make_seed,
                                     list(range(args.seed, args.seed + args.seeds)), cfg,
                                     target=args.fit_h200_mfu, rel_tol=args.rel_tol,
                                     screen_seed=screen_seed if screening else None,
                                     progress=progress)
        args.h200_mfu = calibration["remote_mfu"]
        deps = {n: with_remote_mfu(d, args.h200_mfu) for n, d in deps.items()}
    if args.rate is not None:
        res = compare(model, deps, make, rate=args.rate, cfg=cfg,
                      rate_range=with_rate_range(model, deps), progress=progress)
    else:
        from hyla.disagg.sim.capacity import compare_capacity

        res = compare_capacity(model, deps, make_seed,
                               list(range(args.seed, args.seed + args.seeds)), cfg,
                               search=not args.no_search, rel_tol=args.rel_tol,
                               fractions=fractions,
                               screen_seed=screen_seed if screening else None,
                               progress=progress)
    from hyla.disagg.sim.workload import SyntheticMix, describe

    return {"setup": args.setup, "model": model.to_dict(), "model_source": args.model,
            "workload": {"trace": args.trace, "length_scale": args.length_scale,
                         "output_scale": args.output_scale, "arrivals": arrivals,
                         "synthetic": args.trace is None,
                         **describe(make(args.rate or 1.0))},
            "mode": "fixed rate" if args.rate else "capacity under SLOs",
            "link_gbps": args.link_gbps, "h200_mfu": args.h200_mfu, "inputs": PUBLISHED_INPUTS,
            "profile": args.profile, "calibration": calibration,
            "search": {"requests": args.requests, "min_duration_s": args.min_duration,
                       "screen_requests": args.screen_requests if screening else 0,
                       "stratify": SyntheticMix().stratify if args.trace is None else None},
            **res}


def model_spec(source: str, weight_bits: float = 16.0, deps: dict | None = None):
    """The simulator's :class:`~hyla.disagg.sim.hardware.ModelSpec` of a model directory or
    config.json (only the config is read); ValueError when its weights at ``weight_bits``
    do not fit an instance of ``deps``."""
    import pathlib

    from hyla.disagg.sim.hardware import spec_from_config
    from hyla.model.sizing import read_config

    if not 1 <= weight_bits <= 32:
        raise ValueError(f"--weight-bits must be in [1, 32], got {weight_bits:g}")
    cfg = read_config(source)
    path = pathlib.Path(source).resolve()
    name = path.parent.name if path.is_file() else path.name
    spec = spec_from_config(cfg, name=name, weight_dtype_bytes=weight_bits / 8)
    for dep in (deps or {}).values():
        for prof in (dep.local, dep.remote):
            if prof is not None and prof.free_bytes(spec) <= 0:
                raise ValueError(f"--model {source}: its {spec.total_params / 1e9:,.1f}B "
                                 f"weights at {weight_bits:g} bits "
                                 f"({spec.weight_bytes / 1e9:,.0f} GB) do not fit one "
                                 f"{prof.label()} instance of deployment {dep.name!r}: pass "
                                 f"fewer --weight-bits")
    return spec


def block_cap(model, deps: dict, sim, length_scale: float = 1.0) -> int | None:
    """KV blocks for each decode instance when more than enough fit, else None (all that fit).

    Why: a small model's KV leaves room for tens of millions of blocks on an 8-GPU instance,
    and the simulator's block manager keeps a list of them (minutes and gigabytes for
    nothing). ``max_num_seqs`` sequences of 256K tokens (times ``length_scale``) each is more
    than any workload asks of an instance, so capping there changes no result.
    """
    if not model.kv_bytes_per_token:
        return None
    cap = int(sim.max_num_seqs * (1 << 18) * max(1.0, length_scale) // sim.block_size)
    fits = [(p.free_bytes(model) - sim.max_num_seqs * model.state_bytes)
            // (sim.block_size * model.kv_bytes_per_token)
            for d in deps.values() for p in (d.local, d.remote) if p is not None]
    return cap if min(fits) > cap else None


def _measured(path: str, deps: dict) -> tuple:
    """(model spec of the profile's preset, the deployments with every instance the
    measured engine)."""
    import dataclasses

    import torch

    from hyla.disagg.sim.hardware import load_measured_profile, spec_from_config
    from hyla.model.config import preset

    prof = load_measured_profile(path)
    name = prof.measured.get("preset")
    if name is None:
        raise ValueError(f"profile {path} does not name its model preset ('preset')")
    spec = spec_from_config(preset(name), weight_dtype_bytes=4, kv_dtype=torch.float32)
    return spec, {n: dataclasses.replace(d, local=prof, remote=prof if d.remote else None)
                  for n, d in deps.items()}


def cmd_profile(args: argparse.Namespace, out: Console) -> int:
    import torch

    from hyla.disagg.sim.profile import measure_engine_profile
    from hyla.model import HylaLM
    from hyla.model.config import preset

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = HylaLM(preset(args.preset)).eval()
    kw = dict(prompt_lens=(16, 64, 256), widths=(1, 4), repeats=2, long_context=256) \
        if args.quick else {}
    prof = measure_engine_profile(model, name=f"cpu-{args.threads}thread", **kw)
    prof["preset"] = args.preset
    pathlib.Path(args.json).write_text(json.dumps(prof, indent=1) + "\n")
    out.print(f"prefill: {prof['prefill_overhead_s'] * 1e3:.2f} ms a step + "
              f"{prof['prefill_tok_s']:,.0f} tok/s; decode step: "
              + ", ".join(f"{w}: {t * 1e3:.2f} ms" for w, t in prof["decode_step_s"].items())
              + f"; +{prof['decode_ctx_s'] * 1e9:.0f} ns a context token. wrote {args.json}")
    return 0


# Below this many columns the tables take their compact form (short names, the intervals on
# a second line); a wider terminal gets every figure on one line.
WIDE_COLUMNS = 130


def _table(title: str, wide: bool) -> Table:
    if wide:
        return Table(title=title)
    from rich import box

    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))


def _k(t: int | None) -> str:
    """A threshold in tokens, short: 19,400 -> '19.4K'.

    Example:
        >>> _k(19400), _k(20000), _k(512), _k(None)
        ('19.4K', '20K', '512', '-')
    """
    if t is None:
        return "-"
    return f"{t / 1000:.3g}K" if t >= 1000 else str(t)


def _short_choice(label: str) -> str:
    """'t=20,000, 7 prefill' -> 't=20K\\n7 prefill' (two lines, short).

    Example:
        >>> _short_choice("t=inf (all local), 7 prefill (3 of 5 seeds)").split("\\n")
        ['t=inf', '7 prefill (3/5 seeds)']
    """
    import re

    label = re.sub(r"t=(\d{1,3}(?:,\d{3})+|\d+)",
                   lambda m: "t=" + _k(int(m.group(1).replace(",", ""))), label)
    label = label.replace(" (all remote)", "").replace(" (all local)", "")
    label = re.sub(r" \((\d+) of (\d+) seeds\)", r" (\1/\2 seeds)", label)
    return label.replace(", ", "\n")


def results_table(res: dict, title: str, wide: bool = True) -> Table:
    """``hyla simulate --rate``'s table; ``wide=False``: fits 80 columns (units in the
    headers, goodput in --json and the wide table only)."""
    table = _table(title, wide)
    cols = ("deployment", "rate req/s", "throughput tok/s", "goodput req/s", "TTFT p50",
            "TTFT p90", "TPOT p90", "egress Gbps", "offload", "t final") if wide else \
        ("deployment", "rate\nreq/s", "output\ntok/s", "TTFT\np50 s", "TTFT\np90 s",
         "TPOT\np90 ms", "Gbps\nout", "off-\nload", "t\nfinal")
    for c in cols:
        table.add_column(c, justify="left" if c.startswith("dep") else "right",
                         no_wrap=not wide)
    for name, m in res["deployments"].items():
        t = m.get("threshold_final")
        rate = f"{m.get('capacity_req_s', m.get('rate_req_s')):.2f}"
        if wide:
            table.add_row(name, rate, f"{m['throughput_tok_s']:,.0f}",
                          f"{m['goodput_req_s']:.2f}", f"{m['ttft_p50_s']:.2f} s",
                          f"{m['ttft_p90_s']:.2f} s", f"{m['tpot_p90_s'] * 1e3:.1f} ms",
                          f"{m['egress_gbps']:.1f}", f"{m['offload_fraction']:.0%}",
                          "-" if t is None else f"{t:,}")
        else:
            table.add_row(name, rate, f"{m['throughput_tok_s']:,.0f}", f"{m['ttft_p50_s']:.2f}",
                          f"{m['ttft_p90_s']:.2f}", f"{m['tpot_p90_s'] * 1e3:.1f}",
                          f"{m['egress_gbps']:.1f}", f"{m['offload_fraction']:.0%}", _k(t))
    return table


def _iv(iv: dict, unit: str = "") -> str:
    if iv["half"] is None:
        return f"{iv['mean']:.3g}{unit}"
    return f"{iv['mean']:.3g}{unit} +- {iv['half']:.2g} ({iv['rel_half']:.1%})"


def _iv2(iv: dict) -> str:
    """The mean, and the 95% interval's half-width on a second, dim line."""
    if iv["half"] is None:
        return f"{iv['mean']:.3g}"
    return f"{iv['mean']:.3g}\n[dim]+-{iv['rel_half']:.1%}[/]"


def _modal(labels: list) -> str:
    best = max(set(labels), key=labels.count)
    return best if labels.count(best) == len(labels) else \
        f"{best} ({labels.count(best)} of {len(labels)} seeds)"


def capacity_table(res: dict, title: str, wide: bool = True) -> Table:
    """Each deployment's capacity (mean, 95% interval over seeds) and, for PrfaaS, the
    policy's choice beside the alternatives of its space. ``wide=False``: fits 80 columns
    (short names, the interval under the mean)."""
    table = _table(title, wide)
    cols = ("deployment", "capacity req/s (95%)", "configuration", "TTFT p90", "TPOT p90",
            "egress Gbps", "offload", "t final") if wide else \
        ("deployment", "req/s\n[dim](95%)[/]", "config", "TTFT\np90", "TPOT\np90",
         "Gbps\nout", "off-\nload", "t\nfinal")
    for c in cols:
        table.add_column(c, justify="left" if c.startswith("dep") else "right",
                         no_wrap=not wide)

    def first(e):
        m = e["per_seed"][0]["metrics"]
        t = m.get("threshold_final")
        return (f"{m['ttft_p90_s']:.{2 if wide else 3}{'f' if wide else 'g'}} s"
                if m.get("ttft_p90_s") is not None else "-",
                f"{m['tpot_p90_s'] * 1e3:.1f} ms" if m.get("tpot_p90_s") is not None else "-",
                f"{m['egress_gbps']:.1f}" if m.get("egress_gbps") is not None else "-",
                f"{m['offload_fraction']:.0%}" if m.get("offload_fraction") is not None
                else "-", (f"{t:,}" if wide else _k(t)) if t is not None else "-")
    for name, e in res["deployments"].items():
        if wide:
            label = "prfaas (policy's choice)" if name == "prfaas" else name
            table.add_row(label, _iv(e["capacity"]), _modal(e["choice"]), *first(e))
        else:
            label = "prfaas*" if name == "prfaas" else name
            table.add_row(label, _iv2(e["capacity"]), _short_choice(_modal(e["choice"])),
                          *first(e))
        for fam, iv in e.get("alternatives", {}).items():
            choice = _modal(e["alternative_choices"][fam])
            if wide:
                table.add_row(f"  prfaas: {fam}", _iv(iv), choice, "", "", "", "", "")
            else:
                table.add_row(f"  {fam}", _iv2(iv), _short_choice(choice), "", "", "", "", "")
    if not wide:
        table.caption = ("prfaas*: the policy's choice, the alternatives it weighed below it; "
                         "+-: 95% interval over the seeds (all figures: --json)")
    return table


def cmd_simulate(args: argparse.Namespace, out: Console) -> int:
    if args.list_traces:
        for line in traces_lines():
            out.print(line, markup=False, highlight=False)
        out.print("Use one with --trace NAME (or give a CSV path); provenance and licence: "
                  "hyla/disagg/sim/traces/README.md", markup=False, highlight=False)
        return 0
    res = run_simulate(args, progress=lambda n: out.print(f"[dim]{n}...[/]"))
    if res["mode"] == "fixed rate":
        out.print(results_table(res, f"{res['setup']} setup, {res['mode']}",
                                wide=out.width >= WIDE_COLUMNS))
        for k, v in res["ratios"].items():
            out.print(f"{k.replace('_', ' ')}: [bold]{v:.2f}x[/] throughput")
    else:
        n = len(res["seeds"])
        if res.get("calibration"):
            c = res["calibration"]
            out.print(f"fitted H200 prefill MFU: [bold]{c['remote_mfu']:.1%}[/] of peak, where "
                      f"naive / homogeneous is {_iv(c['ratio'], 'x')} (target "
                      f"{c['target']:g}x; {len(c['steps'])} bisection steps)")
        out.print(capacity_table(res, f"{res['setup']} setup, capacity under SLOs, {n} "
                                 f"seed{'s' * (n > 1)} (metrics: seed {res['seeds'][0]})",
                                 wide=out.width >= WIDE_COLUMNS))
        for k, v in res["ratios"].items():
            out.print(f"{k.replace('_', ' ')}: [bold]{_iv(v, 'x')}[/] capacity "
                      f"(per-seed ratios, same arrivals)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        out.print(f"wrote {args.json}")
    return 0


def traces_lines() -> list[str]:
    """``hyla simulate --list-traces``: the built-in traces and their length percentiles."""
    from hyla.disagg.sim.traces import list_traces

    return [f"{t['name']}: {t['about']} ({t['file']}); {t['requests']:,} requests, "
            f"{'with' if t['arrivals'] else 'no'} arrival times; prompt p50/p90/p99 "
            f"{t['prompt_p50']:,} / {t['prompt_p90']:,} / {t['prompt_p99']:,} tokens, "
            f"output p50/p90 {t['output_p50']:,} / {t['output_p90']:,}" for t in list_traces()]


def cmd_kv_table(args: argparse.Namespace, out: Console) -> int:
    from hyla.disagg.sim.kv_table import kv_table

    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    rows = kv_table(args.tokens)
    table = Table(title=f"State/KV a prefill instance emits at {args.tokens:,} tokens a prompt")
    for c in ("model", "mix", "on", "MB/request", "prefill s", "KV Gbps", "KV+state Gbps",
              "vs dense", "published Gbps"):
        table.add_column(c, justify="right")
    for r in rows:
        pub = r["published_gbps"]
        table.add_row(r["model"], r["mix"], r["instance"], f"{r['transfer_bytes'] / 1e6:,.0f}",
                      f"{r['prefill_s']:.2f}", f"{r['kv_gbps']:.2f}", f"{r['total_gbps']:.2f}",
                      f"{1 / r['reduction_vs_dense']:.2f}x" if r["reduction_vs_dense"] != 1
                      else "1x", "-" if pub is None else str(pub))
    out.print(table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    else:
        sys.stdout.flush()
    return 0
