"""The feed-forward kinds of a block, one module each, behind the :class:`FFN` protocol:
``S`` dense SwiGLU (:mod:`.dense`), ``E`` mixture of experts (:mod:`.moe`)."""

from hyla.model.ffn.base import FFN, FFNS, register_ffn
from hyla.model.ffn.dense import DenseFFN
from hyla.model.ffn.moe import MoEFFN, MoEOptions

__all__ = ["FFN", "FFNS", "DenseFFN", "MoEFFN", "MoEOptions", "register_ffn"]
