"""Pipeline steps for tests/curation/test_executors.py's fork-server test: each records, from its
worker, whether a marker module was imported before its `run` began (xml.dom.minidom: imported by
nothing the executor or the step imports)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from datatrove.pipeline.base import PipelineStep

MARKER = "xml.dom.minidom"


class RecordsImports(PipelineStep):
    name = "records imports"

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        seen = {"marker": MARKER in sys.modules, "own": __name__ in sys.modules, "pid": os.getpid()}
        Path(self.out, f"{rank}.json").write_text(json.dumps(seen))
        yield from data or ()


class NamesItsImport(RecordsImports):
    worker_imports = (MARKER,)
