"""StreamKL: KL divergence between a teacher's and a student's attention distributions.

- :func:`attention_kl`: the op (dispatches to a backend), :class:`AttentionKLLoss`;
- :func:`chunk_attention_kl`: streamed over query and key tiles, O(T) extra memory;
- :func:`naive_attention_kl`: both ``T x S`` distributions materialised: the specification;
- ``hyla.ops.streamkl.triton``: fused forward and backward Triton kernels, chosen by
  :func:`attention_kl` on CUDA when triton imports (imported lazily; tested on CPU through
  Triton's interpreter, ``TRITON_INTERPRET=1``, not yet on a GPU).
"""

from hyla.ops.streamkl.api import AttentionKLLoss, attention_kl
from hyla.ops.streamkl.chunk import chunk_attention_kl
from hyla.ops.streamkl.naive import naive_attention_kl

__all__ = ["AttentionKLLoss", "attention_kl", "chunk_attention_kl", "naive_attention_kl"]
