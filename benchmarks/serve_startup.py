"""``hyla serve`` answers a healthy ``/health`` within seconds of its launch.

``--rounds`` launches of ``hyla serve --checkpoint SOURCE --threads 1``: seconds to the first
answer of ``/health`` and to its first 200, the server's resident memory ``SETTLE`` seconds
later (its quantised layers' copies made, no request served), then ``load_model`` alone in a
fresh process. Two cases of this tree: a first start (an empty prepared-weights cache: the
checkpoint is loaded and quantised, and the entry written) and a next start (the entry read,
:mod:`hyla.model.prepared`);
``--compare REV`` launches that revision's ``hyla`` in alternating rounds. ``--quick``: 1 round.
"""

import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.serve_common import hyla_serve, revision_tree, server, tree_env

LOAD = ("import time, torch; torch.set_num_threads(1); from hyla.model.load import load_model;"
        "t = time.perf_counter(); load_model({!r}); print(time.perf_counter() - t)")
SETTLE = 5.0


def add_args(p) -> None:
    p.add_argument("--checkpoint", default="smollm2", help="a load_model source (%(default)s)")
    p.add_argument("--compare", metavar="REV", help="a git revision to launch beside")


def launch(source: str, tree=None, cache: str | None = None) -> dict:
    """One launch; ``cache``: the prepared-weights cache's directory (None: a new empty one)."""
    with tempfile.TemporaryDirectory() as empty:
        os.environ["HYLA_WEIGHTS_CACHE"] = cache or empty     # the child's environment
        try:
            return _launch(source, tree)
        finally:
            del os.environ["HYLA_WEIGHTS_CACHE"]


def _launch(source: str, tree=None) -> dict:
    with server(hyla_serve(source), tree) as (proc, _, first, healthy):
        time.sleep(SETTLE)
        status = pathlib.Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    load = subprocess.run([sys.executable, "-c", LOAD.format(source)], check=True,
                          capture_output=True, text=True, env=tree_env(tree), cwd=tree)
    return {"first_answer_s": first, "healthy_s": healthy, "rss_settled_mb": rss,
            "load_model_s": float(load.stdout.split()[-1]), "load_average_1m": os.getloadavg()[0]}


def main(run) -> None:
    a = run.args
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(pathlib.Path(tmp) / "prepared")
        launch(a.checkpoint, cache=cache)                # writes the entry the next starts read
        cases = {"this, first start": lambda: launch(a.checkpoint),
                 "this, next start": lambda: launch(a.checkpoint, cache=cache)}
        if a.compare:
            tree = revision_tree(a.compare, tmp)
            cases[a.compare] = lambda: launch(a.checkpoint, tree)
        runs = run.rounds(cases, 1 if a.quick else None)
    rows = [{"tree": k, **{key: statistics.median(r[key] for r in rs) for key in rs[0]}}
            for k, rs in runs.items()]
    run.table(f"hyla serve --checkpoint {a.checkpoint}: start-up (s), medians", rows)
    run.save(rows, runs=runs, checkpoint=a.checkpoint, nice=os.nice(0), summary="; ".join(
        f"{r['tree']}: load_model {r['load_model_s']:.1f} s, healthy after {r['healthy_s']:.1f} s, "
        f"{r['rss_settled_mb']:.0f} MB resident" for r in rows))
