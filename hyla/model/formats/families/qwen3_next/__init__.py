"""Qwen3-Next and Qwen3.5: the config side (:mod:`.family`, registered on import) and the
tensor names (:mod:`.tensors`)."""

from hyla.model.formats.families.qwen3_next import family  # noqa: F401  (registers the family)
