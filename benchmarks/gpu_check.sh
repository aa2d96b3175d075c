#!/usr/bin/env bash
# The GPU check (issue 20): every op's CUDA output against its fp32 CPU reference, chunk_gla
# native vs flash-linear-attention vs SDPA, StreamKL triton vs chunk vs materialised, a
# training step's tokens/s and MFU, serving throughput against transformers' generate, and
# decode tokens/s against context length (eager and CUDA graphs). Sized for one H200 in
# under 8 minutes; writes benchmarks/results/gpu_check.json and prints summary tables.
#
#   bash benchmarks/gpu_check.sh             # on a CUDA machine: install, then measure
#   bash benchmarks/gpu_check.sh --dry-run   # CPU, tiny shapes, no install (what CI runs)
#
# Extra arguments go to benchmarks/gpu_check.py (--sections ops,gla_speed,... --out PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3)"; fi
fi
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done

if [ "$DRY" = 0 ]; then
    # What the check needs, from PyPI: hyla with its GPU (fla, triton), serving and
    # transformers extras. torch is left as the machine has it (its CUDA build); if it is
    # missing, pip's default torch wheel is the CUDA one. With no network but everything
    # already installed, the check still runs.
    echo "==> pip install -e .[gpu,serve,hf] (${PY})"
    if ! "$PY" -m pip install --quiet --disable-pip-version-check -e ".[gpu,serve,hf]"; then
        echo "pip install failed; checking that what is needed imports anyway" >&2
    fi
    "$PY" - <<'PYEOF'
import torch, fla, triton, transformers  # noqa: F401
assert torch.cuda.is_available(), "no CUDA device visible to torch " + torch.__version__
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
PYEOF
fi

# The whole measurement is bounded: sections write the JSON as they finish, so a run cut
# short still leaves a record of what it reached.
exec timeout --signal=INT 450 "$PY" benchmarks/gpu_check.py "$@"
