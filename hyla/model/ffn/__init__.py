"""The feed-forward kinds of a block, one module each, behind the :class:`FFN` protocol:
``S`` dense SwiGLU (:mod:`.dense`), ``E`` mixture of experts (:mod:`.moe`), ``R`` ungated
squared ReLU (:mod:`.squared_relu`), ``N`` none (:mod:`.none`)."""

from hyla.model.ffn.base import FFN, FFNS, register_ffn
from hyla.model.ffn.dense import DenseFFN
from hyla.model.ffn.moe import MoEFFN, MoEOptions
from hyla.model.ffn.none import NoFFN
from hyla.model.ffn.squared_relu import SquaredReluFFN

__all__ = ["FFN", "FFNS", "DenseFFN", "MoEFFN", "MoEOptions", "NoFFN", "SquaredReluFFN",
           "register_ffn"]
