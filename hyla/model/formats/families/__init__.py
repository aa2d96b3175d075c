"""The hybrid transformers families hyla loads and exports (one module each), registered in
:data:`FAMILIES` by ``model_type``."""

from hyla.model.formats.families import (
    bailing_hybrid,  # noqa: F401  (registers the family)
    falcon_h1,  # noqa: F401  (registers the family)
    granite_hybrid,  # noqa: F401  (registers the family)
    kimi_linear,  # noqa: F401  (registers the family)
    lfm2,  # noqa: F401  (registers the family)
    mimo_v2_flash,  # noqa: F401  (registers the family)
    nemotron_h,  # noqa: F401  (registers the family)
    olmo_hybrid,  # noqa: F401  (registers the family)
    qwen3_next,  # noqa: F401  (registers the family)
)
from hyla.model.formats.families.base import FAMILIES, GGUF_FAMILIES, Family, register_family

__all__ = ["FAMILIES", "GGUF_FAMILIES", "Family", "register_family"]
