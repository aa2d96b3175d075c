"""Recall by load: MQAR models trained and tested here (:mod:`.synthetic`, on the models of
:mod:`.models`), key-value recall written as text for any model (:mod:`.text`), and their
plots and files (:mod:`.plots`)."""

from hyla.eval.recall.synthetic import (
    PRESETS,
    RecallPreset,
    best_records,
    recall_preset,
    run_recall,
)

__all__ = ["PRESETS", "RecallPreset", "best_records", "recall_preset", "run_recall"]
