"""Curation: one datatrove pipeline per source turns a corpus artifact into a curated corpus.

Stages (each a datatrove executor run whose logs and `stats.json` stay in the step folder):

    index_*  the held-out index, built by tasks (curation/heldout.py `index_stages`: shards by
             n-gram hash partition, a merge per partition, a finish task); this process only
             lists the held-out shards and reads the finished index's `index.json`
    filter   read train shards (counting unreadable lines) -> preset filters (the web presets
             start with language ID) -> held-out decontamination -> write `filtered/` -> exact-dedup signatures
    exact    find exact duplicates (datatrove ExactFindDedups)
    unique   read `filtered/` -> drop exact duplicates -> write `unique/` -> MinHash signatures
    buckets  MinHash buckets;   cluster  MinHash clusters (bounded memory: curation/minhash_cluster.py)
    final    read `unique/` -> drop near duplicates -> write `train/` (the curated corpus)
    heldout  read the held-out split -> preset filters -> exact dedup -> `heldout/`

Design choices:
- Held-out is held out. The source splits by document id, before any dedup, so copies of a
  held-out document can sit in train. After the filters (so on the text as it will be trained
  on: the `docs` preset rewrites documents to their prose), every training document is matched
  against an index of the held-out documents (this source's, plus those of the `others` corpora
  given): the same text, or a word n-gram overlap with one held-out document at or above
  `decontamination.threshold`, removes the training copy (`heldout_decont:exact`,
  `heldout_decont:overlap`). The index holds every held-out document as the source wrote it,
  so whatever is built from held-out text (the eval suite's cloze items, held-out loss,
  fertility) has no copy in train.
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
import re
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.presets import PRESETS, PresetThresholds
from curation.stages import filter_rows, plan_stages, removed_counts, shard_count
from pipeline.artifact import Artifact, added_identity, operational
from pipeline.step import step

if TYPE_CHECKING:
    from curation.heldout import HeldoutFile
    from curation.source_kinds import SourceConfig


class DecontaminationConfig(BaseModel):
    """Training documents that copy held-out text are removed (see the module docstring)."""

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
    whole by every curate step for decontamination, so it is bounded in documents, not as a share
    of a source (5% of DCLM's ~3B documents would be 150M)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # documents per source at most: enough for the eval suite's items and held-out loss, small
    # enough that the index of all 71 sources of smollm3-3b stays ~1 GB in each curate task
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

    def for_source(self, source: SourceConfig, others: Sequence[SourceConfig] = ()) -> CurationConfig:
        """This section as the curate step of `source` sees it: the presets of the source and of
        the `others` it is decontaminated against, resolved (so the plan shows them and the
        fingerprint holds them: another source's `docs` preset decides which form of its held-out
        text is matched), and its own skip entry only, so changing another source's skip entry
        does not rerun this one. The source's own preset comes first."""
        name = source.name
        presets = {s.name: self.preset_for(s.name, s.domain, s.language) for s in (source, *others)}
        own = presets[name]
        thresholds = self.filters.get(own)
        # a preset at its defaults leaves the fingerprint as it was before thresholds were data
        filters = {own: thresholds} if thresholds is not None and thresholds != PRESETS.get(own).defaults else {}
        return self.model_copy(
            update={
                "presets": presets,
                "minhash_skip": tuple(n for n in self.minhash_skip if n == name),
                "filters": filters,
                "heldout": HeldoutSplitConfig(),  # the source step's: it reaches curate through its input
            }
        )

    def plan_summary(self) -> str:
        """What `smollm3 plan` shows beside a curate step: its source's preset (the first)."""
        return f"preset {next(iter(self.presets.values()))}" if self.presets else ""


def _has_lines(path: Path) -> bool:
    """Whether a gzip JSONL shard, or any of a folder's, holds a non-blank line (a Parquet
    shard: a row)."""
    import gzip

    for shard in sorted(path.glob("*.jsonl.gz")) if path.is_dir() else [path]:
        if shard.suffix == ".parquet":
            import pyarrow.parquet as pq

            if pq.ParquetFile(shard).metadata.num_rows:
                return True
            continue
        if not shard.name.endswith(".jsonl.gz"):
            continue
        with gzip.open(shard, "rb") as fh:
            if any(line.strip() for line in fh):
                return True
    return False


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


def _heldout_files(corpora: Sequence[Artifact], config: CurationConfig) -> list[HeldoutFile]:
    """Every held-out shard of the corpora, in order, with what the index holds of its documents:
    the text as the source wrote it and, where the source's preset rewrites text (`docs`: prose
    only), also as curation keeps it (curation/heldout.py `heldout_forms`). Listing them is all
    this process does with the held-out text: the index is built by tasks on the executor."""
    from curation.filters import DocumentationProseFilter
    from curation.heldout import HeldoutFile

    files = []
    for art in corpora:
        folder = art.path / "heldout"
        if folder.is_dir():
            source = art.meta.get("source", art.short)
            preset = config.preset_for(source, art.meta.get("domain", "web"), art.meta.get("language", "en"))
            rewrites = any(isinstance(f, DocumentationProseFilter) for f in PRESETS.get(preset).filters())
            files += [HeldoutFile(str(path), source, rewrites) for path in sorted(folder.iterdir())]
    return files


def _low_kept_share(rows: list[dict], docs_in: int, kept: int, floor: float) -> dict[str, Any] | None:
    """A source that kept less than `floor` of its documents (every preset keeps all the natural
    paragraphs of tests/tasks/data/multilingual.json: far below that is a preset that does not
    fit the text), with the filter that removed the most and its main reasons; else None."""
    if not docs_in or kept / docs_in >= floor:
        return None
    removals = [(r["docs_in"] - r["docs_out"], r) for r in rows if r["filter"] != "read"]
    removed, worst = max(removals, key=lambda x: x[0]) if removals else (0, {"filter": "read", "reasons": {}})
    reasons = dict(sorted(worst["reasons"].items(), key=lambda kv: -kv[1])[:3])
    share = kept / docs_in
    return {
        "kept_share": round(share, 4),
        "floor": floor,
        "filter": worst["filter"],
        "removed": removed,
        "reasons": reasons,
        "message": (
            f"kept {kept} of {docs_in} documents ({share:.1%}), below curation.min_kept_share "
            f"{floor:g}: {worst['filter']} removed the most ({removed}: "
            f"{', '.join(f'{k} {v}' for k, v in reasons.items())}); check the source's preset "
            "(curation.presets, its language) against a sample of its text"
        ),
    }


def publish_curated(artifact: Artifact, ws, label: str) -> None:
    """Filter statistics to lineage (`filter_stats`) and to a Prefect table artifact; a source
    that kept far less than its preset keeps on natural text also to lineage (`data_events`)
    and as a Prefect event (`smollm3.curation.low_kept_share`)."""
    from prefect.artifacts import create_table_artifact

    rows = json.loads((artifact.path / "filter_stats.json").read_text(encoding="utf-8"))
    source = artifact.meta.get("source", label)
    low = artifact.meta.get("low_kept_share")
    if low:
        from datetime import UTC, datetime

        from prefect.events import emit_event

        facts = {k: low[k] for k in ("filter", "removed", "reasons")}
        ws.lineage().record_rows(
            "data_events",
            [
                (
                    artifact.fingerprint,
                    source,
                    "low_kept_share",
                    low["kept_share"],
                    low["floor"],
                    low["message"],
                    json.dumps(facts, sort_keys=True),
                    datetime.now(UTC).replace(tzinfo=None),
                )
            ],
        )
        emit_event(
            event="smollm3.curation.low_kept_share",
            resource={"prefect.resource.id": f"smollm3.source.{source}", "prefect.resource.name": source},
            payload={"kept_share": low["kept_share"], "floor": low["floor"], **facts},
        )
    ws.lineage().record_rows(
        "filter_stats",
        [
            (
                artifact.fingerprint,
                source,
                r["position"],
                r["filter"],
                r["docs_in"],
                r["docs_out"],
                r["chars_in"],
                r["chars_out"],
                json.dumps(r["reasons"], sort_keys=True),
            )
            for r in rows
        ],
    )
    table = [
        {
            **{k: r[k] for k in ("filter", "docs_in", "docs_out", "chars_in", "chars_out")},
            "reasons": ", ".join(f"{k}={v}" for k, v in sorted(r["reasons"].items())),
        }
        for r in rows
    ]
    create_table_artifact(
        table=table,
        key=f"curate-{re.sub(r'[^a-z0-9-]', '-', source.lower())}",
        description=f"Curation of {source}: documents and characters per filter, removal reasons",
    )


# 6: the web presets identify the language (py3langid) and judge each language with its own
# settings; C4 keeps paragraph breaks; the input is dealt into more shards (source v3)
@step("curate", version=6, kind="corpus", publish=publish_curated, resource="data", isolate=True, retries=1)
def curate(
    config: CurationConfig, corpus: Artifact, others: tuple[Artifact, ...] = (), *, out: Path, log=print
) -> dict[str, Any]:
    """One source's corpus to a curated corpus in `out/train` and `out/heldout`; its train split
    is decontaminated against its own held-out split and those of the `others` corpora (the
    other sources: the eval suite mixes the held-out text of every source of a domain).
    """
    from curation.heldout import INDEX_STAGES, HeldoutIndex, IndexPlan, index_stages
    from curation.heldout import index_report as size_report

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
    against = [corpus, *(o for o in others if o.fingerprint != corpus.fingerprint)]
    index_plan, index_report = None, None
    caps = [a.meta.get("heldout_max_documents") for a in against]  # the index's size at these caps
    if config.decontamination.enabled:
        files = _heldout_files(against, config)
        if any(_has_lines(Path(f.path)) for f in files):
            index_plan = IndexPlan(
                tuple(files),
                out / "work" / "heldout_index",
                config.decontamination.ngram,
                config.decontamination.index_partitions,
                tasks,
            )
        else:  # nothing held out anywhere: no index, no decontamination filter
            index_report = size_report(HeldoutIndex.build([], config.decontamination.ngram).header(), caps)
            log(f"curate {source}: {_describe_index(index_report, len(against))}")
    has_heldout = heldout.is_dir() and _has_lines(heldout)
    stages = plan_stages(
        config,
        preset,
        train,
        out,
        tasks,
        heldout=heldout if has_heldout else None,
        index=index_plan.index if index_plan else None,
    )
    if index_plan is not None:  # built first, by tasks on the executor, as every other stage
        stages = index_stages(index_plan) + stages
    train_stages = [s for s in stages if s[0] not in ("heldout", *INDEX_STAGES)]
    held_stages = [s for s in stages if s[0] == "heldout"]
    run_executors(config, make_executors(config, stages, logs), logs, log)
    seconds = time.monotonic() - start
    if index_plan is not None:  # its size, from its index.json (this process maps none of it)
        index_report = size_report(HeldoutIndex.read_header(index_plan.index), caps)
        log(f"curate {source}: {_describe_index(index_report, len(against))}")
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
    decont = {k: v for k, v in removed.items() if k.startswith("heldout_decont:")}
    log(
        f"curate {source} ({preset}): {docs_in} in -> {documents} kept ({characters} chars) in "
        f"{seconds:.1f}s; held-out {held_in} -> {held_docs}; copies of held-out text removed "
        f"{dict(decont)}; rejected {dict(rejected)}"
    )
    low = _low_kept_share(rows, docs_in, documents, config.min_kept_share)
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
        "decontaminated_against": (sorted({a.meta.get("source", a.short) for a in against}) if index_plan else []),
        # the held-out index every task maps: its size, and at the sources' held-out caps
        "heldout_index": index_report,
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
