"""Pipeline steps for tests/curation/test_executors.py's fork-server test: each records, from its
worker, whether a marker module was imported before its `run` began (xml.dom.minidom: imported by
nothing the executor or the step imports; spaCy, for the steps that split words)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from datatrove.pipeline.base import PipelineStep

MARKER = "xml.dom.minidom"


class RecordsImports(PipelineStep):
    name = "records imports"
    marker = MARKER

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        seen = {"marker": self.marker in sys.modules, "own": __name__ in sys.modules, "pid": os.getpid()}
        Path(self.out, f"{rank}.json").write_text(json.dumps(seen))
        yield from data or ()


class NamesItsImport(RecordsImports):
    worker_imports = (MARKER,)


class SplitsEnglishWords(RecordsImports):
    """A step with datatrove's `language`, as its Gopher, C4 and FineWeb filters have: its words
    are split by spaCy's English tokenizer."""

    marker = "spacy"
    language = "eng"


class RecordsSpacy(RecordsImports):
    """The same record of spaCy, from a step that splits no words."""

    marker = "spacy"
