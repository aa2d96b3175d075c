"""Hugging Face ``transformers`` directories: :mod:`.config` (``config.json`` onto a
:class:`~hyla.model.HylaConfig`), :mod:`.weights` (safetensors and tensor names),
:mod:`.load` (:func:`load_hf`), :mod:`.export` (:func:`export_hf`) and :mod:`.tokenizer`
(``tokenizer.json``, chat templates)."""

from hyla.model.formats.hf.config import (
    ARCHITECTURES,
    EXPORT_FORMATS,
    HF_EXTRAS,
    hf_config_to_hyla,
    is_hf_directory,
)
from hyla.model.formats.hf.export import export_family, export_hf, hyla_to_hf_config
from hyla.model.formats.hf.load import hyla_model_from, load_hf
from hyla.model.formats.hf.weights import hf_state_to_hyla, read_safetensors

__all__ = ["ARCHITECTURES", "EXPORT_FORMATS", "HF_EXTRAS", "export_family", "export_hf",
           "hf_config_to_hyla", "hf_state_to_hyla", "hyla_model_from", "hyla_to_hf_config",
           "is_hf_directory", "load_hf", "read_safetensors"]
