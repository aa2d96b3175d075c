"""Gated delta rule (Gated DeltaNet; KDA with a decay per key channel): every variant takes
(q, k, v, g, beta, ...) and returns (o, final_state).

- :func:`naive_recurrent_gated_delta`: float32 token loop, the specification;
- :func:`chunk_gated_delta`: chunked parallel form (WY / UT transform), training and prefill;
- :func:`recurrent_gated_delta`: the decode form, in place on a state batch.
"""

from hyla.ops.deltanet.checks import l2norm
from hyla.ops.deltanet.chunk import chunk_gated_delta
from hyla.ops.deltanet.naive import naive_recurrent_gated_delta
from hyla.ops.deltanet.recurrent import delta_decode_step, recurrent_gated_delta

__all__ = ["chunk_gated_delta", "delta_decode_step", "l2norm", "naive_recurrent_gated_delta",
           "recurrent_gated_delta"]
