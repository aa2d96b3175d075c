"""The hybrid transformers families hyla loads and exports (one module each), registered in
:data:`FAMILIES` by ``model_type``."""

from hyla.model.formats.families.base import FAMILIES, Family, register_family

__all__ = ["FAMILIES", "Family", "register_family"]
