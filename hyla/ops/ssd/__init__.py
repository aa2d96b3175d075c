"""Mamba-2's state-space dual (SSD): one scalar decay a head, B and C shared by groups of
heads. Every form takes (x, dt, A, B, C, D, ...) in the ``[B, T, H, P]`` layout:

- :func:`naive_ssd`: the token loop in float32, the specification;
- :func:`chunk_ssd`: the chunked form, training and prefill;
- :func:`ssd_decode_step`: one token a sequence, the state updated in place (decode).
"""

from hyla.ops.ssd.chunk import chunk_ssd
from hyla.ops.ssd.naive import naive_ssd
from hyla.ops.ssd.recurrent import ssd_decode_step

__all__ = ["chunk_ssd", "naive_ssd", "ssd_decode_step"]
