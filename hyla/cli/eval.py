"""``hyla eval recall|needle|ppl``: thin maps onto hyla.eval.

Example:
    $ hyla eval recall --preset quick --out benchmarks/results/recall_quick
    $ hyla eval recall --checkpoint smollm2 --pairs 2,8,32 --out recall_smollm2
    $ hyla eval needle --checkpoint runs/quickstart --context 1K,4K
    $ hyla eval ppl --checkpoint runs/quickstart --json
    $ hyla eval harness --checkpoint model.gguf --tasks my_task --include-path tasks/
    $ hyla eval make-mc man --out tasks/ --items 80
    $ hyla eval compare smollm2 runs/distill --tasks heldout_mc --include-path tasks/ \
          --recall-pairs 2,8,32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib

from rich.console import Console
from rich.table import Table

from hyla.cli.common import SOURCE_HELP, Parser, add_allow_nonfinite, positive, torch_threads
from hyla.cli.model_flags import add_quantize, apply_quantize


def add_eval(sub) -> argparse.ArgumentParser:
    """Register ``hyla eval recall|needle|ppl`` on the ``hyla`` sub-parser set."""
    group = sub.add_parser("eval", help="evaluations: recall (MQAR), needle, perplexity, "
                                        "lm-evaluation-harness")
    evals = group.add_subparsers(dest="eval_command", required=True, parser_class=Parser)
    p = evals.add_parser("recall", help="recall by load: train GLA / hybrid / attention "
                                        "models on MQAR, or ask any checkpoint key-value "
                                        "pairs written as text (--checkpoint); plot accuracy "
                                        "vs load and vs state bytes")
    p.add_argument("--preset", default="quick", choices=["quick", "zoology"],
                   help="synthetic sweep, choices quick, zoology: quick is about 28 CPU "
                        "minutes (about 15 on 2 cores with --jobs 2), zoology the paper's "
                        "sweep (GPU) (default: %(default)s)")
    p.add_argument("--checkpoint", default=None,
                   help="instead of the synthetic sweep, text key-value recall of this model: "
                        + SOURCE_HELP + " (default: none)")
    p.add_argument("--pairs", default="2,4,8,16,32,64,128,256",
                   help="--checkpoint: comma-separated loads, key-value pairs in one context "
                        "(default: %(default)s)")
    p.add_argument("--limit", type=positive, default=16,
                   help="--checkpoint: questions scored per load and context kind "
                        "(default: %(default)s)")
    p.add_argument("--queries", type=positive, default=8,
                   help="--checkpoint: questions asked of one context (default: %(default)s)")
    p.add_argument("--context", default="growing,fixed",
                   help="--checkpoint: comma-separated context kinds, choices growing (only "
                        "the facts) and fixed (filler pads every load to one length) "
                        "(default: %(default)s)")
    p.add_argument("--context-len", type=positive, default=None,
                   help="--checkpoint: tokens of a fixed context (default: the largest "
                        "load's facts plus 5%%)")
    p.add_argument("--out", default="recall_results",
                   help="output folder (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--gate-normalizer", type=float, default=None,
                   help="GLA forget-gate normaliser (default: the preset's)")
    # Small models: one thread measured fastest on a shared 2-core machine.
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: 1 for the synthetic sweep, every core "
                        "for --checkpoint)")
    add_allow_nonfinite(p)
    p.add_argument("--jobs", type=positive, default=None,
                   help="synthetic sweep: models trained at once, each in its own process "
                        "with one thread (default: the CPU cores)")
    add_quantize(p)
    p.set_defaults(func=cmd_eval_recall)

    p = evals.add_parser("needle", help="passkey retrieval by context length and depth")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--context", default="1K,2K,4K", help="comma-separated lengths, e.g. 1K,8K")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                   help="comma-separated positions of the passkey, 0 = start, 1 = end")
    p.add_argument("--trials", type=int, default=3, help="passkeys a (context, depth) cell")
    p.add_argument("--seed", type=int, default=0, help="random seed (passkeys, filler)")
    p.add_argument("--out", default=None, help="folder for needle.json and needle.png "
                   "(default: the checkpoint directory, or needle-NAME for other sources)")
    add_allow_nonfinite(p)
    add_quantize(p)
    p.set_defaults(func=cmd_needle)

    p = evals.add_parser("generate", help="what a model writes, greedily: Python functions "
                                          "run against tests, notes recalled, short answers")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--kinds", default="python,recall,qa",
                   help="comma-separated item kinds (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="items a kind (default: all)")
    p.add_argument("--out", default=None, help="file for the JSON results (default: none)")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: torch's, every core)")
    add_allow_nonfinite(p)
    add_quantize(p)
    p.set_defaults(func=cmd_generate)

    p = evals.add_parser("ppl", help="validation perplexity of a checkpoint")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--data", default=None, help="text source (default: stdlib validation split)")
    p.add_argument("--seq-len", "--window", dest="seq_len", type=int, default=512,
                   help="window length: tokens are scored in non-overlapping windows")
    p.add_argument("--max-tokens", type=int, default=65536,
                   help="score at most this many tokens of the data")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_allow_nonfinite(p)
    add_quantize(p)
    p.set_defaults(func=cmd_ppl)

    p = evals.add_parser("harness", help="EleutherAI lm-evaluation-harness tasks, in process "
                                         "(needs the eval extra: pip install 'hyla[eval]')")
    p.add_argument("--checkpoint", required=True, help=SOURCE_HELP)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", default=None,
                   help="folder of task YAML files (local tasks, local data)")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="examples in each prompt (default: each task's own)")
    p.add_argument("--batch-size", type=positive, default=8,
                   help="requests lm-eval scores together")
    p.add_argument("--out", default=None, help="folder for lm-eval's results.json")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads")
    add_allow_nonfinite(p)
    add_quantize(p)
    p.set_defaults(func=cmd_harness)
    add_compare(evals)
    return group


COMMANDS = {"eval": add_eval}


def cmd_eval_recall(args: argparse.Namespace, out: Console) -> int:
    import time

    if args.checkpoint is not None:
        return cmd_text_recall(args, out)
    if args.quantize not in ("none", "auto"):
        raise ValueError(f"--quantize {args.quantize}: the synthetic recall sweep trains its "
                         "models, and quantised weights are for inference only; use it with "
                         "--checkpoint")
    from hyla.eval.recall.plots import plot_recall, write_recall
    from hyla.eval.recall.synthetic import best_records, recall_preset, run_recall
    from hyla.perf import machine_info, print_table

    p = recall_preset(args.preset)
    if args.gate_normalizer is not None:
        p = dataclasses.replace(p, gate_logit_normalizer=args.gate_normalizer)
    sweep = {m: p.lrs_for(m) for m in p.mixers}
    out.print(f"MQAR [bold]{p.name}[/]: " + ", ".join(
        f"{m} (lr {'/'.join(f'{lr:g}' for lr in lrs)})" for m, lrs in sweep.items())
        + f": {sum(map(len, sweep.values()))} trainings of {p.train_steps} steps, "
          f"seed {args.seed}")
    start = time.perf_counter()
    with torch_threads(args.threads or 1):
        records = run_recall(p, seed=args.seed, progress=lambda line: out.print(line),
                             jobs=args.jobs or os.cpu_count() or 1)
    seconds = time.perf_counter() - start
    best = best_records(records)
    write_recall(records, args.out, preset=dataclasses.asdict(p), seed=args.seed,
                 seconds=round(seconds, 1), machine=machine_info())
    plot_recall(best, args.out, title=f"MQAR ({p.name}), best lr per mixer, seed {args.seed}")
    rows = [{k: r[k] for k in ("mixer", "seq_len", "num_kv_pairs", "accuracy", "state_bytes",
                               "lr", "params")} for r in best]
    print_table(f"MQAR recall ({p.name}, best lr per mixer)", rows, console=out)
    out.print(f"{seconds:.0f} s; wrote {args.out}/results.json, accuracy_vs_pairs.png, "
              f"accuracy_vs_state.png")
    return 0


def cmd_text_recall(args: argparse.Namespace, out: Console) -> int:
    """``hyla eval recall --checkpoint``: text key-value recall by load (hyla.eval.recall.text)."""
    import time

    from hyla.eval.recall.plots import plot_recall, write_recall
    from hyla.eval.recall.text import text_recall
    from hyla.model.load import load_model as load_source
    from hyla.model.load import model_name, require_tokenizer
    from hyla.perf import machine_info, print_table

    try:
        pairs = [int(x) for x in args.pairs.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--pairs must be comma-separated positive ints, got {args.pairs!r}"
                         ) from e
    if not pairs or min(pairs) < 1:
        raise ValueError(f"--pairs must be comma-separated positive ints, got {args.pairs!r}")
    contexts = [c.strip() for c in args.context.split(",") if c.strip()]
    if not contexts or set(contexts) - {"growing", "fixed"}:
        raise ValueError(f"--context must be growing, fixed or both, got {args.context!r}")
    name = model_name(args.checkpoint)
    start, cpu = time.perf_counter(), time.process_time()
    with torch_threads(args.threads):
        model, tok = load_source(args.checkpoint)
        require_tokenizer(tok, args.checkpoint, f"hyla eval {args.eval_command}")
        apply_quantize(model, args, out)
        loaded = time.perf_counter() - start
        records = text_recall(model, tok, pairs, contexts=contexts, limit=args.limit,
                              queries=args.queries, seed=args.seed,
                              context_len=args.context_len, name=name,
                              progress=lambda line: out.print(line))
    seconds = time.perf_counter() - start
    write_recall(records, args.out, checkpoint=str(args.checkpoint), model=name,
                 layers=model.cfg.layers, pairs=pairs, contexts=contexts, limit=args.limit,
                 queries=args.queries, seed=args.seed, load_seconds=round(loaded, 1),
                 seconds=round(seconds, 1),
                 cpu_seconds=round(time.process_time() - cpu, 1), machine=machine_info())
    plot_recall(records, args.out, title=f"key-value recall in text: {name}, seed {args.seed}")
    rows = [{k: r[k] for k in ("context", "num_kv_pairs", "seq_len", "accuracy", "correct",
                               "queries", "state_bytes")} for r in records]
    print_table(f"text key-value recall of {name} (exact match)", rows, console=out)
    out.print(f"{seconds:.0f} s; wrote {args.out}/results.json, accuracy_vs_pairs.png, "
              f"accuracy_vs_state.png")
    return 0


def cmd_needle(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.memory import parse_context
    from hyla.eval.needle import needle_eval, plot_needle
    from hyla.model.load import load_model as load_source
    from hyla.model.load import model_name, require_tokenizer

    contexts = [parse_context(c) for c in args.context.split(",") if c.strip()]
    try:
        depths = [float(d) for d in args.depths.split(",")]
    except ValueError as e:
        raise ValueError(f"depths must be comma-separated numbers in [0, 1], got "
                         f"{args.depths!r}") from e
    model, tok = load_source(args.checkpoint)
    require_tokenizer(tok, args.checkpoint, f"hyla eval {args.eval_command}")
    apply_quantize(model, args, out)
    records = needle_eval(model, tok, contexts, depths, trials=args.trials, seed=args.seed)
    table = Table(title=f"passkey retrieval accuracy ({args.trials} trials a cell)")
    table.add_column("depth")
    for c in contexts:
        table.add_column(f"{c:,}", justify="right")
    for d in depths:
        table.add_row(f"{d:.0%}", *[f"{r['accuracy']:.2f}" for c in contexts for r in records
                                    if r["context"] == c and r["depth"] == d])
    out.print(table)
    folder = pathlib.Path(args.out) if args.out else pathlib.Path(args.checkpoint)
    if not args.out and not folder.is_dir():       # a .gguf file or a hub id
        folder = pathlib.Path(f"needle-{model_name(args.checkpoint)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "needle.json").write_text(json.dumps(records, indent=1) + "\n")
    plot_needle(records, folder / "needle.png")
    out.print(f"wrote {folder / 'needle.json'} and {folder / 'needle.png'}")
    return 0


def cmd_generate(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.generation import KINDS, generation_eval
    from hyla.model.load import load_model as load_source
    from hyla.model.load import require_tokenizer

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if not kinds or set(kinds) - set(KINDS):        # named before any model is loaded
        raise ValueError(f"--kinds {args.kinds!r}: choose from {', '.join(KINDS)}")
    model, tok = load_source(args.checkpoint)
    require_tokenizer(tok, args.checkpoint, f"hyla eval {args.eval_command}")
    apply_quantize(model, args, out)
    with torch_threads(args.threads):
        r = generation_eval(model, tok, kinds=kinds, limit=args.limit)
    table = Table(title=f"greedy generation, {r['items']} items ({r['seconds']:.0f} s)")
    table.add_column("kind")
    table.add_column("right", justify="right")
    for kind, share in r["by_kind"].items():
        table.add_row(kind, f"{share:.2f}")
    table.add_row("all", f"{r['score']:.2f}")
    out.print(table)
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1) + "\n")
        out.print(f"wrote {path}")
    return 0


def cmd_ppl(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.perplexity import perplexity
    from hyla.model.load import load_model as load_source
    from hyla.model.load import require_tokenizer

    model, tok = load_source(args.checkpoint)
    require_tokenizer(tok, args.checkpoint, f"hyla eval {args.eval_command}")
    apply_quantize(model, args, None if args.json else out)
    r = perplexity(model, tok, args.data, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(r))
    else:
        table = Table(title=f"perplexity of {args.checkpoint}")
        for col in ("perplexity", "loss (nats/token)", "tokens scored", "windows", "window"):
            table.add_column(col, justify="right")
        table.add_row(f"{r['perplexity']:.2f}", f"{r['loss']:.4f}", f"{r['tokens']:,}",
                      str(r["windows"]), str(r["seq_len"]))
        out.print(table)
    return 0


def cmd_harness(args: argparse.Namespace, out: Console) -> int:
    try:
        from hyla.eval.harness import run_harness
    except ImportError as e:
        raise ValueError(str(e)) from None
    from lm_eval.utils import make_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    with torch_threads(args.threads):
        model = tok = None
        if args.quantize != "none":
            from hyla.model.load import load_model as load_source
            from hyla.model.load import require_tokenizer

            model, tok = load_source(args.checkpoint)
            require_tokenizer(tok, args.checkpoint, f"hyla eval {args.eval_command}")
            apply_quantize(model, args, out)
        try:
            results = run_harness(args.checkpoint, tasks, include_path=args.include_path,
                                  limit=limit, batch_size=args.batch_size,
                                  num_fewshot=args.num_fewshot, out=args.out,
                                  model=model, tokenizer=tok)
        except (RuntimeError, FileNotFoundError) as e:  # no network, a missing data file
            raise ValueError(f"{e} (a task's data_files are relative to the current "
                             "directory)" if isinstance(e, FileNotFoundError) else str(e)
                             ) from None
    print(make_table(results))
    if args.out:
        out.print(f"wrote {pathlib.Path(args.out) / 'results.json'}")
    return 0


def add_compare(evals) -> None:
    """``hyla eval compare TEACHER STUDENT`` and ``hyla eval make-mc SOURCE``."""
    p = evals.add_parser("compare", help="teacher and student side by side: perplexity, "
                                         "passkey, lm-eval task accuracy, recall by load")
    p.add_argument("teacher", metavar="TEACHER", help="the reference model: " + SOURCE_HELP)
    p.add_argument("student", metavar="STUDENT", help="the model compared with it (e.g. a "
                                                      "hyla distill run directory)")
    p.add_argument("--tasks", default="",
                   help="comma-separated lm-eval tasks, installed ones by name or local ones "
                        "under --include-path (default: none)")
    p.add_argument("--include-path", default=None,
                   help="folder of local task YAML files, e.g. from hyla eval make-mc "
                        "(default: none)")
    p.add_argument("--limit", type=positive, default=None,
                   help="documents scored per task, and generated items a kind with "
                        "--generation (default: all)")
    p.add_argument("--recall-pairs", default=None,
                   help="comma-separated loads of the text key-value recall, e.g. 2,8,32 "
                        "(default: no recall)")
    p.add_argument("--recall-limit", type=positive, default=16,
                   help="questions a recall load (default: %(default)s)")
    p.add_argument("--ppl-tokens", type=positive, default=4096,
                   help="held-out tokens of perplexity (default: %(default)s; --full: 16384)")
    p.add_argument("--full", action="store_true",
                   help="the full report: 16K perplexity tokens and 8 passkeys a length "
                        "(default: off, 2 passkeys a length)")
    p.add_argument("--data", default=None,
                   help="held-out text for perplexity (default: the stdlib validation split)")
    p.add_argument("--generation", action="store_true",
                   help="also score what both write greedily: Python functions run against "
                        "tests, notes recalled, short answers (hyla eval generate)")
    p.add_argument("--out", default="compare_results",
                   help="folder for compare.json and the recall plots (default: %(default)s)")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: torch's, every core)")
    add_allow_nonfinite(p)
    p.set_defaults(func=cmd_compare)

    from hyla.eval.heldout_mc import MAN_PAGES

    p = evals.add_parser("make-mc", help="a held-out 4-way multiple-choice lm-eval task from "
                                         "plain prose (question: a paragraph's opening, "
                                         "answer: its next sentence)")
    p.add_argument("source", metavar="SOURCE",
                   help="man (the manual pages " + ", ".join(MAN_PAGES[:6]) + ", ...), "
                        "man:PAGE,PAGE, a text file, or a folder of .txt/.md/.rst files")
    p.add_argument("--out", required=True,
                   help="folder for NAME.yaml, NAME.jsonl, NAME.meta.json (required)")
    p.add_argument("--items", type=positive, default=80,
                   help="questions in the task (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the paragraph and distractor draw (default: %(default)s)")
    p.add_argument("--name", default="heldout_mc",
                   help="task name, letters, digits and _ (default: %(default)s)")
    p.set_defaults(func=cmd_make_mc)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be comma-separated positive ints (e.g. 2,8,32), "
                         f"got {text!r}")
    return values


def compare_rows(r: dict) -> list[dict]:
    """The rows of ``hyla eval compare``'s table: one a measure, teacher / student / ratio."""
    t, s = r["teacher"]["report"], r["student"]["report"]

    def row(measure, a, b, ratio=None):
        if ratio is None and isinstance(a, int | float) and isinstance(b, int | float) and a:
            ratio = b / a
        return {"measure": measure, "teacher": a, "student": b,
                "student/teacher": "" if ratio is None else f"{ratio:.3f}"}

    rows = [row(f"perplexity, {n}-token windows", t["perplexity"][n]["perplexity"],
                s["perplexity"][n]["perplexity"]) for n in t["perplexity"]]
    for n in t["passkey"]:
        a, b = t["passkey"][n], s["passkey"][n]
        rows.append(row(f"passkey at {n} tokens", f"{a['correct']}/{a['trials']}",
                        f"{b['correct']}/{b['trials']}"))
    rows.append(row("state bytes a sequence at 8K", t["state_bytes_8k"], s["state_bytes_8k"]))
    rows.append(row("parameters", t["parameters"], s["parameters"]))
    for k in r["skills"]:
        rows.append(row(f"{k['task']} ({k['metric']}, {k['samples']} docs)", k["teacher"],
                        k["student"], k["ratio"]))
    for k in r["recall"]:
        rows.append(row(f"recall at {k['num_kv_pairs']} pairs ({k['queries']} questions)",
                        k["teacher"], k["student"], k["ratio"]))
    for k in r.get("generation", []):
        rows.append(row(f"generation, {k['kind']} ({k['items']} items, greedy)",
                        k["teacher"], k["student"], k["ratio"]))
    return rows


def cmd_compare(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.compare import compare_models
    from hyla.perf import machine_info, print_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    pairs = _int_list(args.recall_pairs, "--recall-pairs") if args.recall_pairs else None
    if tasks:
        try:
            import hyla.eval.harness  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--tasks: {e}") from None
    with torch_threads(args.threads):
        try:
            r = compare_models(args.teacher, args.student, tasks=tasks,
                               include_path=args.include_path, limit=args.limit,
                               recall_pairs=pairs, recall_limit=args.recall_limit,
                               ppl_tokens=args.ppl_tokens, full=args.full, data=args.data,
                               generation=args.generation,
                               progress=lambda line: out.print(line))
        except (RuntimeError, FileNotFoundError) as e:  # no network, a missing data file
            raise ValueError(f"{e} (a task's data_files are relative to the current "
                             "directory)" if isinstance(e, FileNotFoundError) else str(e)
                             ) from None
    folder = pathlib.Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    r = {"teacher_source": str(args.teacher), "student_source": str(args.student), **r,
         "machine": machine_info()}
    (folder / "compare.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    print_table(f"{r['student']['name']} ({r['student']['layers']}) against "
                f"{r['teacher']['name']}", compare_rows(r), console=out)
    wrote = [folder / "compare.json"]
    if r["recall"]:
        from hyla.eval.recall.plots import plot_recall

        wrote += plot_recall(r["teacher"]["recall"] + r["student"]["recall"], folder,
                             title="key-value recall in text: teacher and student")
    out.print("wrote " + ", ".join(str(p) for p in wrote))
    return 0


def cmd_make_mc(args: argparse.Namespace, out: Console) -> int:
    from hyla.eval.heldout_mc import make_mc

    meta = make_mc(args.source, args.out, items=args.items, seed=args.seed, name=args.name)
    out.print(f"{meta['items']} items of {meta['choices']} choices from "
              f"{len(meta['documents'])} document(s) of {args.source} (seed {args.seed}, "
              f"sha256 {meta['sha256'][:12]}); wrote {args.out}/{args.name}.yaml, "
              f".jsonl, .meta.json")
    out.print(f"run: hyla eval harness --checkpoint MODEL --tasks {args.name} "
              f"--include-path {args.out}")
    return 0
