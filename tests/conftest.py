"""Suite-wide settings."""

import os

import torch

# The tests run tiny models, whose ops are far smaller than the cost of waking a second
# intra-op thread: on 2-vCPU VMs one thread runs them 2-10x faster. Subprocesses (servers,
# torchrun workers) inherit the setting through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Prepared weights (hyla.model.prepared) go to a directory of this run's own, not the home
# cache: the tests see entries they made, and leave nothing behind in ~/.cache.
import tempfile  # noqa: E402

os.environ.setdefault("HYLA_WEIGHTS_CACHE", tempfile.mkdtemp(prefix="hyla-weights-"))
