"""Lineage: one DuckDB file per workspace recording runs, steps, artifacts, their edges and facts.

`store.py` is the write side (a journal per process, ingested under a file lock, the schema, read
connections and private snapshots); `queries.py` is what lineage answers (`Lineage`: ancestry,
runs, what a checkpoint was trained on, experiments). Import from here:

    from pipeline.lineage import Lineage
"""

from pipeline.lineage.queries import Lineage, TrainedOn, artifact_of
from pipeline.lineage.store import (
    RUN_STATES,
    JournalRejected,
    LineageError,
    LineageStore,
    StepRow,
)

__all__ = [
    "RUN_STATES",
    "JournalRejected",
    "Lineage",
    "LineageError",
    "LineageStore",
    "StepRow",
    "TrainedOn",
    "artifact_of",
]
