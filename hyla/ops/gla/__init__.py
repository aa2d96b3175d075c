"""Gated Linear Attention: every variant takes (q, k, v, g, ...) and returns (o, final_state).

- :func:`naive_recurrent_gla`: fp32 token loop, the specification;
- :func:`chunk_gla`: chunked parallel form for training and prefill;
- :func:`recurrent_gla`: the decode form, in place on a state batch.
"""

from hyla.ops.gla.chunk import chunk_gla
from hyla.ops.gla.naive import naive_recurrent_gla
from hyla.ops.gla.recurrent import gla_decode_step, recurrent_gla

__all__ = ["chunk_gla", "gla_decode_step", "naive_recurrent_gla", "recurrent_gla"]
