"""The preset check before compute: a sample of each readable source through its curation preset.

A preset that suits its source keeps most of it; one that does not (English stop words judging
French, a prose stack judging code) keeps almost nothing, and the curate step would fail "kept
no documents" only after the cluster jobs ran. `smollm3 recipe`, `smollm3 plan` and the flow
entry (flows/recipe.py check_data) read the first `curation.sample_documents` documents (at most
`curation.sample_chars` characters) of every
source readable here (builtin, local files, save_to_disk folders; hub datasets need the network
and are left to the run) and apply the source's preset filters to them in this process, in the
order the pipeline would. A kept share below `curation.min_kept_share` refuses the recipe,
naming the source, the preset and the filter that removed the most.

The sample is the source's first documents, so it is a smoke test of the preset, not an estimate
of what curation keeps of the whole source (docs/data.md has the measured figures).

Results are kept in `<workspace>/checks/presets/`, keyed by everything they depend on (the
source's config and file digest, the curation section as the source's curate step sees it, the
curate step's version): the first check imports datatrove and spaCy and takes seconds, a repeat
reads a small JSON file, so `smollm3 recipe` and `smollm3 plan` stay light commands.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from curation.presets import quality_filters
from curation.source_kinds import Document, SourceConfig, resolve_kind, source_state
from infra.files import read_json, write_json_atomic
from pipeline.artifact import canonical_json, identity
from tasks.curate import CurationConfig, curate


@dataclass(frozen=True)
class SampleResult:
    source: str
    preset: str
    documents: int  # documents in the sample
    kept: int  # documents every filter kept
    removed: Counter  # "filter:reason" -> documents removed there (the first filter to drop them)

    @property
    def kept_share(self) -> float:
        return self.kept / self.documents if self.documents else 1.0


def sample_source(config: CurationConfig, source: SourceConfig, seed: int = 0) -> SampleResult:
    """The first documents of `source` through its preset, counted per filter and reason."""
    from datatrove.data import Document as DatatroveDocument

    from curation.filters import filter_name

    preset = config.preset_for(source.name, source.domain, source.language)
    filters = quality_filters(config, preset)
    records = (r for r in resolve_kind(source.uri)(source, seed).records() if isinstance(r, Document))
    kept, total, chars, removed = 0, 0, 0, Counter[str]()
    for record in itertools.islice(records, config.sample_documents):
        if chars >= config.sample_chars:
            break
        total += 1
        chars += len(record.text)
        doc = DatatroveDocument(text=record.text, id=record.id, metadata=dict(record.metadata))
        for f in filters:
            verdict = f.filter(doc)
            if verdict is True or (isinstance(verdict, tuple) and verdict[0]):
                continue
            reason = verdict[1] if isinstance(verdict, tuple) and len(verdict) > 1 else filter_name(f)
            removed[f"{filter_name(f)}:{reason}"] += 1
            break
        else:
            kept += 1
    return SampleResult(source.name, preset, total, kept, removed)


def _cache_key(config: CurationConfig, source: SourceConfig, seed: int) -> str:
    facts = {
        "source": identity(source),
        "state": source_state(source, seed),
        "curation": identity(config.for_source(source)),
        "sample": [config.sample_documents, config.sample_chars],
        "curate_version": curate.version,
    }
    return hashlib.sha256(canonical_json(facts).encode()).hexdigest()[:16]


def cached_sample(config: CurationConfig, source: SourceConfig, seed: int, cache: Path | None) -> SampleResult:
    """`sample_source`, read from `cache` when the same check ran before (written after)."""
    path = cache / f"{_cache_key(config, source, seed)}.json" if cache is not None else None
    known = read_json(path) if path is not None and path.is_file() else None
    if isinstance(known, dict):
        return SampleResult(
            known["source"], known["preset"], known["documents"], known["kept"], Counter(known["removed"])
        )
    result = sample_source(config, source, seed)
    if path is not None:
        try:
            write_json_atomic(path, {**result.__dict__, "removed": dict(result.removed)})
        except OSError:  # a read-only workspace: the check still answers, uncached
            pass
    return result


def preset_problems(
    config: CurationConfig, sources: list[SourceConfig], seed: int = 0, cache: Path | None = None
) -> list[str]:
    """One message per readable source whose sample keeps less than `min_kept_share`."""
    problems = []
    for source in sources:
        if not resolve_kind(source.uri)(source, seed).is_readable():
            continue
        result = cached_sample(config, source, seed, cache)
        if result.documents and result.kept_share < config.min_kept_share:
            worst = ", ".join(f"{k} {v}" for k, v in result.removed.most_common(3))
            problems.append(
                f"sources[{source.name}]: preset {result.preset!r} keeps {result.kept} of its first "
                f"{result.documents} documents ({result.kept_share:.0%}, below curation.min_kept_share "
                f"{config.min_kept_share:g}); removed by {worst}. Give the source the preset that suits "
                f"it (curation.presets.{source.name}, or its language/domain), or lower min_kept_share"
            )
    return problems
