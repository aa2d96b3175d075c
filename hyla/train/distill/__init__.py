"""``hyla distill``: a softmax-attention teacher turned into a hybrid student.

- :mod:`.pipeline`: :class:`Distiller`, the two stages end to end (attention transfer, then
  end-to-end KL), resumable from each stage's checkpoint;
- :mod:`.config` and :mod:`.recipes`: the settings and the named recipes (``--recipe``);
- :mod:`.student`: the student built from the teacher, weights copied where they fit;
- :mod:`.layer_ranking` and :mod:`.kl_ranking`: which teacher layers stay attention
  (``--layers auto:N``), from the teacher's own hidden states (:mod:`.teacher_hooks`);
- :mod:`.objectives` and :mod:`.losses`: what a stage's step costs;
- :mod:`.report`: ``report.json``, what the student kept of the teacher.

:class:`Distiller` and :func:`load_teacher` are imported from here when asked for, so the CLI's
parser, which reads the config and recipes, does not load the training pipeline.
"""


def __getattr__(name: str):
    if name in ("Distiller", "load_teacher"):
        from hyla.train.distill import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'hyla.train.distill' has no attribute {name!r}")


__all__ = ["Distiller", "load_teacher"]
