"""Model: config and presets, the mixers, the HylaLM module, the batch context, per-sequence
state, generation, and ``load_model`` for every checkpoint format."""

from hyla.model.config import PRESETS, HylaConfig, preset
from hyla.model.context import Context
from hyla.model.generate import generate
from hyla.model.load import load_model
from hyla.model.mixers import MIXERS, Mixer, StateSpec, TensorSpec, register_mixer
from hyla.model.model import HylaLM
from hyla.model.state import SequenceState

__all__ = ["MIXERS", "PRESETS", "Context", "HylaConfig", "HylaLM", "Mixer", "SequenceState",
           "StateSpec", "TensorSpec", "generate", "load_model", "preset", "register_mixer"]
