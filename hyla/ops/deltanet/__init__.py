"""Gated delta rule (Gated DeltaNet; KDA with a decay per key channel): every variant takes
(q, k, v, g, beta, ...) and returns (o, final_state).

- :func:`naive_recurrent_gated_delta`: float32 token loop, the specification;
- :func:`chunk_gated_delta`: chunked parallel form (WY / UT transform), training and prefill;
- :func:`recurrent_gated_delta`: the decode form (in place on a state batch with
  ``inplace=True``).

``chunk_gated_delta`` and ``recurrent_gated_delta`` here dispatch (:mod:`hyla.ops.backends`):
native PyTorch by default, flash-linear-attention's kernels on CUDA when ``fla`` is
installed; the native ones stay importable from their modules.
"""

from hyla.ops.backends import dispatched
from hyla.ops.checks.deltanet import l2norm
from hyla.ops.deltanet import chunk as _chunk
from hyla.ops.deltanet import recurrent as _recurrent
from hyla.ops.deltanet.naive import naive_recurrent_gated_delta
from hyla.ops.deltanet.recurrent import delta_decode_step

chunk_gated_delta = dispatched("chunk_gated_delta", _chunk.chunk_gated_delta)
recurrent_gated_delta = dispatched("recurrent_gated_delta", _recurrent.recurrent_gated_delta)

__all__ = ["chunk_gated_delta", "delta_decode_step", "l2norm", "naive_recurrent_gated_delta",
           "recurrent_gated_delta"]
