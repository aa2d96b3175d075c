"""Model: config and presets, the HylaLM module, per-sequence state, generation."""

from hyla.model.config import PRESETS, HylaConfig, preset
from hyla.model.generate import generate
from hyla.model.model import HylaLM
from hyla.model.state import SequenceState

__all__ = ["PRESETS", "HylaConfig", "HylaLM", "SequenceState", "generate", "preset"]
