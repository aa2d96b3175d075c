"""hyla's benchmarks: one module a claim, run by ``python -m benchmarks run NAME`` on the shared
harness (:mod:`benchmarks.harness`); ``python -m benchmarks list`` names them."""
