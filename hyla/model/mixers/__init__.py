"""The layer kinds of a hybrid model, one module each, behind the :class:`Mixer` protocol.

``G``: gated linear attention (:mod:`.gla`; with ``linear_window``, the linearised attention of
:mod:`.window_gla`); ``A``: softmax attention (:mod:`.attention`);
``D`` (and ``K``, its per-key-channel decay): the gated delta rule (:mod:`.deltanet`; with
``linear_window``, :mod:`.window_delta`);
``M``: multi-head latent attention (:mod:`.mla`); ``S``: Mamba-2 (:mod:`.mamba2`); ``C``:
LFM2's gated short convolution (:mod:`.short_conv`); ``P``: attention and Mamba-2 side by
side (Falcon-H1's layer, :mod:`.parallel`).
A new kind is one module that subclasses :class:`Mixer` and registers its letter.
"""

from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.base import (
    MIXERS,
    Mixer,
    StateSpec,
    TensorSpec,
    layer_specs,
    mixer_of_kind,
    register_mixer,
)
from hyla.model.mixers.deltanet import GatedDeltaMixer, KDAMixer
from hyla.model.mixers.gla import GLAMixer
from hyla.model.mixers.linearised.delta import WindowedDeltaMixer, WindowedKDAMixer
from hyla.model.mixers.linearised.gla import WindowedGLAMixer
from hyla.model.mixers.mamba2 import Mamba2Mixer, Mamba2Options
from hyla.model.mixers.mla import MLAMixer
from hyla.model.mixers.parallel import ParallelHybridMixer
from hyla.model.mixers.short_conv import ShortConvMixer, ShortConvOptions

__all__ = ["MIXERS", "AttentionMixer", "GLAMixer", "GatedDeltaMixer", "KDAMixer", "MLAMixer",
           "Mamba2Mixer", "Mamba2Options", "Mixer", "ParallelHybridMixer", "ShortConvMixer",
           "ShortConvOptions", "StateSpec", "TensorSpec", "WindowedDeltaMixer",
           "WindowedGLAMixer", "WindowedKDAMixer", "layer_specs", "mixer_of_kind",
           "register_mixer"]
