#!/usr/bin/env bash
# The GPU check (docs/gpu.md): `python -m benchmarks run gpu_check --help` says what it
# measures. On a CUDA machine this installs hyla[gpu,serve,hf] (torch left as the machine has
# it), then measures into benchmarks/results/gpu_check.json; `--dry-run` runs the same code on
# the CPU at tiny shapes, without installing (what the tests run). Other arguments go to the
# benchmark (--sections ops,gla_speed,... --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY="$(command -v python3)"; }
if [[ " $* " != *" --dry-run "* ]]; then
    # with no network but everything already installed, the check still runs
    "$PY" -m pip install --quiet --disable-pip-version-check -e ".[gpu,serve,hf]" \
        || echo "pip install failed; checking that what is needed imports anyway" >&2
    "$PY" -c 'import torch, fla, triton, transformers
assert torch.cuda.is_available(), "no CUDA device visible to torch " + torch.__version__
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
fi
# bounded: the results file is rewritten after every section, so a run cut short still
# leaves a record of what it reached
exec timeout --signal=INT 450 "$PY" -m benchmarks run gpu_check "$@"
