"""StreamKL: KL divergence between a teacher's and a student's attention distributions.

- :func:`attention_kl`: the op (dispatches to a backend), :class:`AttentionKLLoss`;
- :func:`chunk_attention_kl`: streamed over query and key tiles, O(T) extra memory;
- :func:`naive_attention_kl`: both ``T x S`` distributions materialised: the specification.

No fused Triton kernel ships yet: one that cannot be tested here is not shipped.
"""

from hyla.ops.streamkl.api import AttentionKLLoss, attention_kl
from hyla.ops.streamkl.chunk import chunk_attention_kl
from hyla.ops.streamkl.naive import naive_attention_kl

__all__ = ["AttentionKLLoss", "attention_kl", "chunk_attention_kl", "naive_attention_kl"]
