"""The held-out index step: one per DAG, the index of every source's held-out split, built once.

Its inputs are every source's raw corpus (the source steps' artifacts); its artifact is the
folder `index/` of curation/heldout.py's `HeldoutIndex` (`index.json` written last: a folder
without it is no index), which every `decontaminate` step (tasks/decontaminate.py) memory-maps
in its filter tasks. Before, each of the recipe's curate steps built the same index again, and
so waited for every source to be ingested; now curation of a source starts as soon as that
source is ingested and only decontamination waits for this step.

The index is built by curation/heldout.py's three stages (`index_shards`, `index_merge`,
`index_finish`) on the recipe's curation executor; this process lists the held-out shards and
reads the finished index's `index.json`, nothing more. The arrays are the same whatever the
shard and partition counts (tests/curation/test_heldout.py), so both are operational.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.presets import PRESETS
from pipeline.artifact import Artifact, operational
from pipeline.step import step


class HeldoutIndexSpec(BaseModel):
    """The step's config: how held-out text is indexed, and where the build's tasks run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # every source's curation preset: a source whose preset rewrites text (`docs`: prose only)
    # has each held-out document's kept form indexed too (curation/heldout.py `heldout_forms`)
    presets: dict[str, str] = {}
    ngram: int = Field(default=8, ge=3)  # word n-gram size (the recipe's curation.decontamination.ngram)
    partitions: int = operational(16, gt=0)  # merge tasks, a power of two (curation.decontamination.index_partitions)
    tasks: int = operational(8, gt=0)  # shard tasks at most (one per held-out file at most; curation.tasks)
    # where the tasks run: the recipe's curation executor (curation/executors.py)
    executor: Literal["local", "slurm", "ray"] = operational("local")
    workers: int | None = operational(None, gt=0)
    slurm: SlurmExecutorConfig | None = operational(None)
    ray: RayExecutorConfig = operational(RayExecutorConfig())

    @classmethod
    def of(cls, curation: Any, sources: Sequence[Any]) -> HeldoutIndexSpec:
        """The step's config from the recipe's `curation` section and its sources."""
        decont = curation.decontamination
        return cls(
            presets={s.name: curation.preset_for(s.name, s.domain, s.language) for s in sources},
            ngram=decont.ngram,
            partitions=decont.index_partitions,
            tasks=curation.tasks,
            **{k: getattr(curation, k) for k in ("executor", "workers", "slurm", "ray")},
        )

    def preset_of(self, corpus: Artifact) -> str:
        """A corpus's preset: its entry, else its domain's (as `CurationConfig.preset_for`)."""
        source = corpus.meta.get("source", corpus.short)
        if source in self.presets:
            return self.presets[source]
        domain, language = corpus.meta.get("domain", "web"), corpus.meta.get("language", "en")
        return f"web-{language}" if domain == "web" and language != "en" else domain


def _heldout_files(corpora: Sequence[Artifact], config: HeldoutIndexSpec) -> list:
    """Every held-out shard of the corpora, in order, with whether its source's preset rewrites
    text (then the index holds each document's kept form too)."""
    from curation.filters import DocumentationProseFilter
    from curation.heldout import HeldoutFile

    files = []
    for art in corpora:
        folder = art.path / "heldout"
        if folder.is_dir():
            source = art.meta.get("source", art.short)
            rewrites = any(
                isinstance(f, DocumentationProseFilter) for f in PRESETS.get(config.preset_of(art)).filters()
            )
            files += [HeldoutFile(str(path), source, rewrites) for path in sorted(folder.iterdir())]
    return files


def _describe_index(report: dict, sources: int) -> str:
    """`held-out index: 1,204 documents of 3 sources, 98,120 n-grams, 1.4 MB memory-mapped by
    each task; at the sources' caps (6,000 documents): 7.0 MB` (or `no cap: it grows with the
    sources`)."""
    mb = report["bytes"] / 1e6
    text = (
        f"held-out index: {report['documents']:,} documents of {sources} sources, {report['ngrams']:,} n-grams, "
        f"{mb:.1f} MB memory-mapped by each task"
    )
    if report["bytes_at_cap"] is None:
        return text + "; a source without curation.heldout.max_docs: it grows with the sources' held-out fraction"
    return (
        text
        + f"; at the sources' caps ({report['documents_at_cap']:,} documents): {report['bytes_at_cap'] / 1e6:.1f} MB"
    )


# 1: the index of curation/heldout.py, built once per DAG (before: inside every curate step)
@step("heldout_index", version=1, kind="heldout_index", resource="data", isolate=True, retries=1)
def heldout_index(
    config: HeldoutIndexSpec, corpora: tuple[Artifact, ...] = (), *, out: Path, log=print
) -> dict[str, Any]:
    """Every corpus's held-out split to one index in `out/index`; the meta gives its size now and
    at the sources' held-out caps (`curation.heldout.max_docs`)."""
    from curation.heldout import HeldoutIndex, IndexPlan, index_report, index_stages
    from curation.stages import has_lines

    unique = list({a.fingerprint: a for a in corpora}.values())
    sources = sorted({a.meta.get("source", a.short) for a in unique})
    caps = [a.meta.get("heldout_max_documents") for a in unique]
    files = _heldout_files(unique, config)
    if any(has_lines(Path(f.path)) for f in files):
        # built in this folder: `shards/` and `parts/` (removed once the index is whole), `index/`
        plan = IndexPlan(tuple(files), out, config.ngram, config.partitions, config.tasks)
        stages = index_stages(plan)
        logs = out / "logs"
        run_executors(config, make_executors(config, stages, logs), logs, log)
        header = HeldoutIndex.read_header(plan.index)  # its build finished (this process maps none of it)
        for work in ("shards", "parts"):
            shutil.rmtree(out / work, ignore_errors=True)
    else:  # nothing held out anywhere: an empty index, which removes nothing
        HeldoutIndex.build([], config.ngram).save(out / "index")
        header = HeldoutIndex.read_header(out / "index")
    report = index_report(header, caps)
    log(f"heldout_index: {_describe_index(report, len(sources))}")
    return {
        "sources": sources if header["documents"] else [],
        "ngram": config.ngram,
        # the index every decontamination task maps: its size, and at the sources' held-out caps
        "heldout_index": report,
    }
