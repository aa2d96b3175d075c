"""Gated Linear Attention: every variant takes (q, k, v, g, ...) and returns (o, final_state).

- :func:`naive_recurrent_gla`: fp32 token loop, the specification;
- :func:`chunk_gla`: chunked parallel form for training and prefill;
- :func:`recurrent_gla`: the decode form (in place on a state batch with ``inplace=True``).

``chunk_gla`` and ``recurrent_gla`` here dispatch (:mod:`hyla.ops.backends`): hyla's native
PyTorch ops by default, flash-linear-attention's kernels on CUDA when ``fla`` is installed,
either forced by ``backend=`` or ``$HYLA_OPS_BACKEND``. The native ones stay importable from
their modules (``hyla.ops.gla.chunk.chunk_gla``).
"""

from hyla.ops.backends import dispatched
from hyla.ops.gla import chunk as _chunk
from hyla.ops.gla import recurrent as _recurrent
from hyla.ops.gla.naive import naive_recurrent_gla
from hyla.ops.gla.recurrent import gla_decode_step

chunk_gla = dispatched("chunk_gla", _chunk.chunk_gla)
recurrent_gla = dispatched("recurrent_gla", _recurrent.recurrent_gla)

__all__ = ["chunk_gla", "gla_decode_step", "naive_recurrent_gla", "recurrent_gla"]
