"""Curation: one datatrove pipeline per source turns a corpus artifact into a curated corpus.

Stages (each a datatrove executor run whose logs and `stats.json` stay in the step folder):

    filter   read train shards (counting unreadable lines) -> preset filters (the web presets
             start with language ID) -> write `filtered/` -> exact-dedup signatures
    exact    find exact duplicates (datatrove ExactFindDedups)
    unique   read `filtered/` -> drop exact duplicates -> write `unique/` -> MinHash signatures
    buckets  MinHash buckets;   cluster  MinHash clusters (bounded memory: curation/minhash_cluster.py)
    final    read `unique/` -> drop near duplicates -> write `train/` (the curated corpus)
    heldout  read the held-out split -> preset filters -> exact dedup -> `heldout/`

Design choices:
- A source is curated from its own corpus alone, so its curation starts as soon as it is
  ingested. Held-out decontamination, which needs every source's held-out split, is two steps
  after it in the DAG (flows/smollm3.py): `heldout_index` (tasks/heldout_index.py) builds the
  index of every source's held-out split once, and `decontaminate` (tasks/decontaminate.py)
  matches each source's curated train split against it. A filter rewrites a document's text
  (the `docs` preset keeps its prose, C4 drops lines) and leaves the hash of the text as written
  in its metadata (`rewritten_from_hash`) for that step, which removes the key.
- Decontamination runs after dedup, where it ran before it inside this step (before curate v7).
  Both remove every training document that copies held-out text; what can differ is which copy
  of a duplicate cluster stays: exact dedup keeps the first of identical texts and MinHash one
  document per cluster, so when that representative is a held-out copy, decontamination removes
  it and the cluster leaves train whole, where before the copy was removed first and another
  member of the cluster was kept. The kept set is the same or smaller (docs/data.md gives the
  tiny recipe's counts).
- The held-out split goes through the same language and preset filters as train (and exact
  dedup within itself), so fertility, held-out loss and evals measure the kind of text the
  model trains on. Its removals are counted apart (`heldout_removed`).
- Presets per domain are lists of datatrove filters (a registry refuses duplicates): `web` is the
  FineWeb stack (language ID keeping English, Gopher repetition and quality, C4 with paragraph
  breaks kept, FineWeb quality), `web-XX` the same stack for language XX with its word
  tokenizer, stop words and thresholds (a web source's default: its `language`;
  curation/languages.py), `docs` is the English stack for documentation prose, `code` is
  heuristics that suit source code, `math` is light (length only). Our own datatrove
  components (the counting reader, code filters, prose extraction, language ID, decontamination,
  sample writer) live in the curation/ package, free of Prefect, because datatrove's worker
  processes import the modules of the pipeline's components. Nothing is downloaded: the filters
  need spaCy's rule-based tokenizers (`spacy.blank`), language ID py3langid's bundled model.
- One name per filter (`filter_name`): the filter_stats row, the `removed/<name>/` folder and
  the `<name>:<reason>` keys of the meta all use it.
- Bad input is counted, never dropped silently: the reader counts malformed JSON, invalid UTF-8,
  missing or non-string text, empty and too large documents and blank lines per reason; every filter's drops
  are counted per reason by datatrove; a few removed documents per filter and reason are kept in
  `removed/` (train) and `heldout_removed/` for inspection. The meta counts what this step
  dropped, once: the source step's own rejections stay in the source's meta.
- Dedup stages read their input rank by rank (`{rank:05d}.jsonl.gz`) because datatrove's MinHash
  and exact-dedup filters address documents by their index within a rank's stream.
- The executor is datatrove's LocalPipelineExecutor by default, running `workers` tasks at once
  (unset: the machine's cores); `slurm` and `ray` build datatrove's Slurm/Ray executors chained
  by `depends`, for clusters. `tasks` is fingerprinted (it sets the output shards), `workers`
  is not: the output is the same whatever the worker count.

`python -m flows.filter_counts RECIPE SOURCE [key=value ...]` runs one source and its curation
outside the flow and prints the per-filter table (docs/data.md records its figures for the tiny
recipe); this module has no command of its own.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.presets import PRESETS, PresetThresholds
from curation.stages import (
    filter_rows,
    has_lines,
    low_kept_share,
    plan_stages,
    publication,
    removed_counts,
    shard_count,
)
from pipeline.artifact import Artifact, added_identity, operational
from pipeline.step import step

if TYPE_CHECKING:
    from curation.source_kinds import SourceConfig


class DecontaminationConfig(BaseModel):
    """Training documents that copy held-out text are removed: the heldout_index step builds the
    index (tasks/heldout_index.py), the decontaminate step of each source matches against it
    (tasks/decontaminate.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True  # off only to measure what contamination costs
    ngram: int = Field(default=8, ge=3)  # word n-gram size (the eval contamination report's default)
    # share of a held-out document's n-grams (or of the training document's, when it is the
    # shorter) that makes a copy: 0.5 removes near duplicates and texts holding most of a
    # held-out document, not texts that merely share boilerplate lines
    threshold: float = Field(default=0.5, gt=0, le=1)
    # a held-out document counts as at least this many n-grams, so a short one (a license
    # header) cannot make every long text that quotes it a copy; 50 is one prose cloze item
    min_ngrams: int = Field(default=50, ge=1)
    # merge tasks of the index's build (a power of two): each sorts 1/index_partitions of the
    # index's n-grams (~20 bytes each measured: 0.20 GB per task projected for smollm3-3b's
    # ~106M at 16, docs/scale.md); the index is the same whatever the count
    index_partitions: int = operational(16, gt=0)

    @field_validator("index_partitions")
    @classmethod
    def _power_of_two(cls, n: int) -> int:
        if n & (n - 1):
            raise ValueError(f"must be a power of two (the top bits of an n-gram's hash pick its partition), got {n}")
        return n


class HeldoutSplitConfig(BaseModel):
    """The recipe's `curation.heldout`: how large each source's held-out split may grow. The split
    is made by the source step (tasks/sources.py, `SourceSpec.held_out_max_documents`) and indexed
    whole by the heldout_index step for decontamination, so it is bounded in documents, not as a
    share of a source (5% of DCLM's ~3B documents would be 150M)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # documents per source at most: enough for the eval suite's items and held-out loss, small
    # enough that the index of all 71 sources of smollm3-3b stays ~1 GB in each decontaminate task
    # (docs/scale.md); None: the sources' held_out_fraction alone
    max_docs: int | None = Field(default=2000, gt=0)


class CurationConfig(BaseModel):
    """The recipe's `curation` section: filters, dedup and where the pipelines run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    executor: Literal["local", "slurm", "ray"] = operational("local")  # datatrove executor kind
    tasks: int = Field(default=8, gt=0)  # datatrove tasks = output shards (capped by the input shards)
    # tasks run at once (local: processes); None: as many as this machine's cores (local) or
    # all of them (slurm, ray). The output is the same whatever the count.
    workers: int | None = operational(None, gt=0)
    presets: dict[str, str] = {}  # source name -> preset name, overriding the domain's preset
    max_document_chars: int = Field(default=1_000_000, gt=0)  # longer documents: too_large
    exact_dedup: bool = True  # drop documents whose text is identical to an earlier one
    minhash: bool = True  # drop near duplicates (MinHash LSH, FineWeb's settings by default)
    # sources kept out of near-dup removal: templated synthetic text (generated math problems)
    # is near-duplicate by construction, and SmolLM3 did not MinHash its synthetic sets either
    minhash_skip: tuple[str, ...] = ()
    minhash_ngrams: int = Field(default=5, gt=0)  # word n-gram size of the shingles
    minhash_buckets: int = Field(default=14, gt=0)  # LSH bands
    minhash_hashes_per_bucket: int = Field(default=8, gt=0)  # rows per band (~0.72 Jaccard cut)
    decontamination: DecontaminationConfig = DecontaminationConfig()  # train vs held-out copies
    # the held-out split's size per source; it enters the source steps' fingerprints (where it
    # can bind), never the curate steps' (`for_source` leaves it at its default)
    heldout: HeldoutSplitConfig = added_identity(HeldoutSplitConfig())
    # language ID of the web presets: py3langid's bundled model, or this local fastText model
    # (lid.176.bin); never a download
    language_model: str | None = None
    removed_samples: int = Field(default=20, ge=0)  # removed documents kept per filter and reason
    # the check before compute (`smollm3 recipe`/`plan`, flows/datacheck.py): each readable
    # source's first documents go through its preset; below this kept share the recipe is refused
    min_kept_share: float = operational(0.2, ge=0, le=1)
    sample_documents: int = operational(100, gt=0)  # documents per source that check curates, at most
    sample_chars: int = operational(50_000, gt=0)  # and characters (the check takes ~1 s per source)
    slurm: SlurmExecutorConfig | None = operational(None)  # required when executor is slurm
    ray: RayExecutorConfig = operational(RayExecutorConfig())  # used when executor is ray
    # preset name -> its filters' thresholds, laid over the preset's defaults (curation/presets.py):
    # `filters.web.gopher_quality.min_doc_words: 100`. Left empty (every preset at its published
    # thresholds) it is out of the fingerprint; the curate step of a source holds its own
    # preset's entry only, and only when it differs from the defaults (docs/data.md)
    filters: dict[str, PresetThresholds] = added_identity({})

    @field_validator("filters", mode="before")
    @classmethod
    def _over_defaults(cls, filters: Any) -> Any:
        if not isinstance(filters, dict):
            return filters
        merged = {}
        for name, given in filters.items():
            if name not in PRESETS:
                raise ValueError(f"curation.filters.{name}: unknown preset; allowed: {', '.join(PRESETS.names())}")
            merged[name] = PRESETS.get(name).merged(name, given)
        return merged

    def preset_for(self, name: str, domain: str, language: str = "en") -> str:
        """The preset of a source: its `presets` entry, else its domain's preset in its language
        (`web` for English web text, `web-fr` for French, ...)."""
        if name in self.presets:
            return self.presets[name]
        return f"web-{language}" if domain == "web" and language != "en" else domain

    def for_source(self, source: SourceConfig) -> CurationConfig:
        """This section as the curate step of `source` sees it: its own preset, resolved (so the
        plan shows it and the fingerprint holds it), its own skip entry and thresholds only, so
        changing another source's does not rerun this one; the decontamination settings and the
        held-out cap at their defaults (the heldout_index and decontaminate steps hold the first,
        the source step the second)."""
        name = source.name
        own = self.preset_for(name, source.domain, source.language)
        thresholds = self.filters.get(own)
        # a preset at its defaults leaves the fingerprint as it was before thresholds were data
        filters = {own: thresholds} if thresholds is not None and thresholds != PRESETS.get(own).defaults else {}
        return self.model_copy(
            update={
                "presets": {name: own},
                "minhash_skip": tuple(n for n in self.minhash_skip if n == name),
                "filters": filters,
                "decontamination": DecontaminationConfig(),  # the decontaminate step's (tasks/decontaminate.py)
                "heldout": HeldoutSplitConfig(),  # the source step's: it reaches curate through its input
            }
        )

    def plan_summary(self) -> str:
        """What `smollm3 plan` shows beside a curate step: its source's preset (the first)."""
        return f"preset {next(iter(self.presets.values()))}" if self.presets else ""


def publish_curated(artifact: Artifact, ws, label: str) -> None:
    """Filter statistics to lineage (`filter_stats`) and to a Prefect table artifact; a source
    that kept far less than its preset keeps on natural text also to lineage (`data_events`)
    and as a Prefect event (`smollm3.curation.low_kept_share`): curation/stages.py `publication`."""
    from prefect.artifacts import create_table_artifact
    from prefect.events import emit_event

    rows = json.loads((artifact.path / "filter_stats.json").read_text(encoding="utf-8"))
    out = publication(artifact.fingerprint, artifact.meta.get("source", label), rows, artifact.meta)
    if out["event"]:
        ws.lineage().record_rows("data_events", out["data_events"])
        emit_event(**out["event"])
    ws.lineage().record_rows("filter_stats", out["filter_stats"])
    create_table_artifact(**out["table"])


# 6: the web presets identify the language (py3langid) and judge each language with its own
# settings; C4 keeps paragraph breaks; the input is dealt into more shards (source v3)
# 7: no decontamination here (the decontaminate step after it, against the index built once)
@step("curate", version=7, kind="corpus", publish=publish_curated, resource="data", isolate=True, retries=1)
def curate(config: CurationConfig, corpus: Artifact, *, out: Path, log=print) -> dict[str, Any]:
    """One source's corpus to a curated corpus in `out/train` and `out/heldout`: filters, exact
    and MinHash dedup; decontamination against every source's held-out text is the next step's
    (tasks/decontaminate.py), so this one needs its own source only.
    """
    source = corpus.meta.get("source", corpus.short)
    domain = corpus.meta.get("domain", "web")
    language = corpus.meta.get("language", "en")
    if corpus.meta.get("format", "jsonl") != "jsonl":
        raise ValueError(
            f"curation of source {source!r}: reads gzip JSONL shards, but the corpus is "
            f"{corpus.meta.get('format')}; set output_format: jsonl on that source"
        )
    preset = config.preset_for(source, domain, language)
    if source in config.minhash_skip:
        config = config.model_copy(update={"minhash": False})
    PRESETS.get(preset)  # unknown preset names fail here, naming the allowed ones
    train = corpus.path / "train"
    heldout = corpus.path / "heldout"
    tasks = max(1, min(config.tasks, shard_count(train)))
    logs = out / "logs"
    start = time.monotonic()
    has_heldout = heldout.is_dir() and has_lines(heldout)
    stages = plan_stages(config, preset, train, out, tasks, heldout=heldout if has_heldout else None)
    train_stages = [s for s in stages if s[0] != "heldout"]
    held_stages = [s for s in stages if s[0] == "heldout"]
    run_executors(config, make_executors(config, stages, logs), logs, log)
    seconds = time.monotonic() - start
    rows = filter_rows(logs, train_stages)
    held_rows = filter_rows(logs, held_stages)
    (out / "train").mkdir(exist_ok=True)
    (out / "heldout").mkdir(exist_ok=True)
    if (out / "work").exists():
        shutil.rmtree(out / "work")
    # the last row's output is what the final writer wrote (no second read of the corpus)
    documents, characters = (rows[-1]["docs_out"], rows[-1]["chars_out"]) if rows else (0, 0)
    held_docs, held_chars = (held_rows[-1]["docs_out"], held_rows[-1]["chars_out"]) if held_rows else (0, 0)
    rejected = Counter[str]()
    for r in rows[:1] + held_rows[:1]:
        if r["filter"] == "read":
            rejected.update(r["reasons"])
    removed, held_removed = removed_counts(rows), removed_counts(held_rows)
    docs_in = rows[0]["docs_in"] if rows else 0
    held_in = held_rows[0]["docs_in"] if held_rows else 0
    # every input line must end kept, rejected or removed; anything else is a bug to see
    unaccounted = (docs_in + held_in) - (
        documents + held_docs + sum(rejected.values()) + sum(removed.values()) + sum(held_removed.values())
    )
    if unaccounted:
        log(f"curate {source}: {docs_in + held_in} lines in but {unaccounted} not accounted for")
    (out / "filter_stats.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    (out / "heldout_filter_stats.json").write_text(json.dumps(held_rows, indent=2), encoding="utf-8")
    log(
        f"curate {source} ({preset}): {docs_in} in -> {documents} kept ({characters} chars) in "
        f"{seconds:.1f}s; held-out {held_in} -> {held_docs}; rejected {dict(rejected)}"
    )
    low = low_kept_share(rows, docs_in, documents, config.min_kept_share)
    if low is not None:  # in the task log; publish_curated records it in lineage and as an event
        log(f"WARNING curate {source} ({preset}): {low['message']}")
    if documents == 0:
        raise ValueError(
            f"curation of source {source!r} with preset {preset!r} kept no documents; see "
            f"{out / 'filter_stats.json'} and {out / 'removed'} and relax the preset "
            "(curation.presets) for this source"
        )
    return {
        "source": source,
        "domain": domain,
        "language": language,
        "preset": preset,
        "format": "jsonl",
        "documents": documents,
        "characters": characters,
        "input_documents": docs_in,
        "heldout_curated": True,  # heldout/ went through the same filters (fertility reads this)
        "heldout_documents": held_docs,
        "heldout_characters": held_chars,
        "heldout_input_documents": held_in,
        # set by the decontaminate step (tasks/decontaminate.py), which carries this meta forward
        "decontaminated_against": [],
        "heldout_index": None,
        # what this step dropped, each document once (the source step's rejections stay in
        # the source's meta): unreadable lines of either split, train removals, held-out removals
        "rejected": dict(rejected),
        "removed": dict(removed),
        "heldout_removed": dict(held_removed),
        "unaccounted": unaccounted,
        **({"low_kept_share": low} if low is not None else {}),
        "seconds": round(seconds, 2),
        "executor": config.executor,
        "tasks": tasks,
    }
