"""Curation: one datatrove pipeline per source turns a corpus artifact into a curated corpus.

Stages (each a datatrove executor run whose logs and `stats.json` stay in the step folder):

    filter   read train shards (counting unreadable lines) -> preset filters (the web presets
             start with language ID) -> held-out decontamination -> write `filtered/` -> exact-dedup signatures
    exact    find exact duplicates (datatrove ExactFindDedups)
    unique   read `filtered/` -> drop exact duplicates -> write `unique/` -> MinHash signatures
    buckets  MinHash buckets;   cluster  MinHash clusters
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from curation.languages import LANGUAGES
from infra.registry import Registry
from pipeline.artifact import Artifact, operational
from pipeline.step import step

if TYPE_CHECKING:
    from datatrove.pipeline.filters.base_filter import BaseFilter

    from tasks.sources import SourceConfig

# The pipeline components live in the curation/ package, which imports datatrove (a third of a
# second and more): they are imported where a pipeline is built, so validating a recipe or
# planning a flow (which read only the configs and preset names here) stays fast. The names stay
# importable from this module (`from tasks.curate import HeldoutIndex`), loaded on first use.
_PARTS = {
    "AlphanumericFractionFilter": "curation.filters",
    "AutogeneratedFilter": "curation.filters",
    "CodeLineLengthFilter": "curation.filters",
    "DocumentationProseFilter": "curation.filters",
    "ExactDedupInMemoryFilter": "curation.filters",
    "LengthFilter": "curation.filters",
    "ParagraphC4QualityFilter": "curation.filters",
    "filter_name": "curation.filters",
    "CountingJsonlReader": "curation.io",
    "SampleWriter": "curation.io",
    "HeldoutDecontFilter": "curation.heldout",
    "HeldoutIndex": "curation.heldout",
    "exact_text": "curation.heldout",
    "LanguageIDFilter": "curation.multilingual",
    "LocalLID": "curation.multilingual",
}


def __getattr__(name: str) -> Any:
    if name in _PARTS:
        import importlib

        return getattr(importlib.import_module(_PARTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SlurmExecutorConfig(BaseModel):
    """Where curation runs on a Slurm cluster (datatrove SlurmPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: str  # Slurm partition to submit to
    time: str = "24:00:00"  # wall-clock limit of each array job
    cpus_per_task: int = Field(default=1, gt=0)  # CPUs per datatrove task
    mem_per_cpu_gb: int = Field(default=2, gt=0)  # memory per CPU
    qos: str = "normal"  # Slurm quality of service
    venv_path: str | None = None  # activate this virtualenv in the jobs (else the submitting env)
    sbatch_args: dict[str, str] = {}  # extra `#SBATCH` options, e.g. {"account": "lm"}
    poll_seconds: float = Field(default=60.0, ge=0.01)  # how often to check for finished tasks (a floor)


class RayExecutorConfig(BaseModel):
    """Where curation runs on a Ray cluster (datatrove RayPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus_per_task: int = Field(default=1, gt=0)  # CPUs reserved per datatrove task
    mem_per_cpu_gb: float = Field(default=2.0, gt=0)  # memory reserved per CPU


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
        return self.model_copy(
            update={"presets": presets, "minhash_skip": tuple(n for n in self.minhash_skip if n == name)}
        )

    def plan_summary(self) -> str:
        """What `smollm3 plan` shows beside a curate step: its source's preset (the first)."""
        return f"preset {next(iter(self.presets.values()))}" if self.presets else ""


# --- presets ----------------------------------------------------------------------------------

# A preset builds its filters from the curation section (the web presets read its language
# model); the pipeline gives each its exclusion writer, named by `filter_name`, so removed
# samples sit in the folder the stats name.
Preset = Callable[[CurationConfig], "list[BaseFilter]"]
PRESETS: Registry[Preset] = Registry("curation preset")


def _web(language: str) -> Preset:
    def build(config: CurationConfig) -> list[BaseFilter]:
        from curation.languages import LANGUAGES
        from curation.multilingual import web_filters

        return web_filters(LANGUAGES[language], config.language_model)

    build.__doc__ = f"FineWeb's stack for {language} web text (curation/languages.py)."
    return build


# `web` is English FineWeb (language ID keeping English, then Gopher repetition and quality,
# C4, FineWeb quality, with their published thresholds); `web-XX` is the same stack for
# language XX with its word tokenizer, stop words and thresholds (curation/languages.py).
PRESETS.register("web")(_web("en"))
for _code in LANGUAGES:
    if _code != "en":
        PRESETS.register(f"web-{_code}")(_web(_code))


@PRESETS.register("docs")
def docs_preset(config: CurationConfig) -> list[BaseFilter]:
    """Documentation prose (READMEs, docstrings, reference manuals): its prose is extracted
    first, then the web stack judges it with two rules changed for what documentation is.

    - GopherQuality's share of words with a letter: 0.7 instead of 0.8. Documentation quotes
      identifiers ("assert", `os.path`), and spaCy counts every quote and bracket as a word:
      the pydoc topics, plain English, score 0.70-0.78.
    - C4's curly-bracket rule is off: it drops a whole document for one `{`, which documentation
      writes when it talks about dict literals and format strings.
    Everything else (Gopher repetition, the other Gopher and C4 rules, FineWeb quality) is the
    web preset's, thresholds included. docs/data.md has the per-filter counts on builtin:prose.
    """
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter

    from curation.filters import DocumentationProseFilter, ParagraphC4QualityFilter

    return [
        DocumentationProseFilter(),
        GopherRepetitionFilter(),
        GopherQualityFilter(max_non_alpha_words_ratio=0.7),
        ParagraphC4QualityFilter(filter_no_terminal_punct=False, filter_curly_bracket=False),
        FineWebQualityFilter(),
    ]


@PRESETS.register("code")
def code_preset(config: CurationConfig) -> list[BaseFilter]:
    """Heuristics that suit source code (English prose filters would drop most of it)."""
    from curation.filters import AlphanumericFractionFilter, AutogeneratedFilter, CodeLineLengthFilter

    return [CodeLineLengthFilter(), AlphanumericFractionFilter(), AutogeneratedFilter()]


@PRESETS.register("math")
def math_preset(config: CurationConfig) -> list[BaseFilter]:
    """Light: math text is symbol-heavy, so prose heuristics misfire; keep only a length floor."""
    from curation.filters import LengthFilter

    return [LengthFilter(min_chars=20)]


@PRESETS.register("none")
def no_preset(config: CurationConfig) -> list[BaseFilter]:
    """No quality filters (dedup, decontamination and input accounting still apply)."""
    return []


# --- pipelines and executors ------------------------------------------------------------------


def quality_filters(config: CurationConfig, preset: str) -> list[BaseFilter]:
    """The preset's filters: fresh instances for each pipeline."""
    if config.language_model and not Path(config.language_model).expanduser().is_file():
        raise FileNotFoundError(
            f"curation.language_model {config.language_model!r} is not a file; give the path of "
            "a local fastText language-id model (e.g. lid.176.bin) or remove the setting (the "
            "web presets then use py3langid's bundled model)"
        )
    return PRESETS.get(preset)(config)


def attach_samples(pipeline: list, folder: Path, per_reason: int) -> list:
    """Give every filter of `pipeline` (datatrove's dedup filters included: they take an
    exclusion writer without being BaseFilters) a sample writer at `folder/<filter_name>`."""
    from curation.filters import filter_name
    from curation.io import SampleWriter

    for component in pipeline:
        if hasattr(component, "exclusion_writer"):
            component.exclusion_writer = (
                SampleWriter(str(folder / filter_name(component)), per_reason) if per_reason else None
            )
    return pipeline


def plan_stages(
    config: CurationConfig,
    preset: str,
    train: Path,
    out: Path,
    tasks: int,
    *,
    heldout: Path | None = None,
    index: Path | None = None,
) -> list[tuple[str, list, int]]:
    """The curation stages as (name, datatrove pipeline, tasks), in order.

    `index` (a saved HeldoutIndex) adds decontamination after the reader; `heldout` (a folder
    of held-out shards) adds the `heldout` stage, one task: the split is small by design and an
    in-memory exact dedup needs to see all of it.
    """
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.exact_dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    from curation.filters import ExactDedupInMemoryFilter
    from curation.heldout import HeldoutDecontFilter, exact_text
    from curation.io import CountingJsonlReader

    decont = config.decontamination
    read = CountingJsonlReader(str(train), max_chars=config.max_document_chars)
    exact_cfg = ExactDedupConfig(content_getter=exact_text, hash_config=HashConfig(precision=64))
    mh_cfg = MinhashConfig(
        n_grams=config.minhash_ngrams,
        num_buckets=config.minhash_buckets,
        hashes_per_bucket=config.minhash_hashes_per_bucket,
        hash_config=HashConfig(precision=64),
    )
    work = out / "work"
    final = str(out / "train")
    filtered = final if not (config.exact_dedup or config.minhash) else str(work / "filtered")
    stages: list[tuple[str, list, int]] = []
    # Decontamination judges the text that will be trained on: after the filters, one of which
    # (documentation prose) rewrites the text and can turn a partial copy into a near duplicate.
    first: list = [read, *quality_filters(config, preset)]
    if index is not None:
        first.append(HeldoutDecontFilter(str(index), decont.threshold, decont.min_ngrams))
    first.append(JsonlWriter(filtered, output_filename="${rank}.jsonl.gz"))
    if config.exact_dedup:
        first.append(ExactDedupSignature(str(work / "exact_sigs"), config=exact_cfg))
    stages.append(("filter", first, tasks))
    current = filtered
    if config.exact_dedup:
        unique = final if not config.minhash else str(work / "unique")
        stages.append(
            ("exact", [ExactFindDedups(str(work / "exact_sigs"), str(work / "exact_dups"), config=exact_cfg)], 1)
        )
        second = [
            CountingJsonlReader(current, rank_files=True),
            ExactDedupFilter(str(work / "exact_dups"), config=exact_cfg),
            JsonlWriter(unique, output_filename="${rank}.jsonl.gz"),
        ]
        if config.minhash:
            second.append(MinhashDedupSignature(str(work / "minhash_sigs"), config=mh_cfg))
        stages.append(("unique", second, tasks))
        current = unique
    elif config.minhash:
        stages.append(
            (
                "signatures",
                [
                    CountingJsonlReader(current, rank_files=True),
                    MinhashDedupSignature(str(work / "minhash_sigs"), config=mh_cfg),
                ],
                tasks,
            )
        )
    if config.minhash:
        stages.append(
            (
                "buckets",
                [MinhashDedupBuckets(str(work / "minhash_sigs"), str(work / "minhash_buckets"), config=mh_cfg)],
                config.minhash_buckets,
            )
        )
        stages.append(
            (
                "cluster",
                [MinhashDedupCluster(str(work / "minhash_buckets"), str(work / "minhash_remove"), config=mh_cfg)],
                1,
            )
        )
        stages.append(
            (
                "final",
                [
                    CountingJsonlReader(current, rank_files=True),
                    MinhashDedupFilter(str(work / "minhash_remove")),
                    JsonlWriter(final, output_filename="${rank}.jsonl.gz"),
                ],
                tasks,
            )
        )
    for _, pipeline, _ in stages:
        attach_samples(pipeline, out / "removed", config.removed_samples)
    if heldout is not None:
        held = [
            CountingJsonlReader(str(heldout), max_chars=config.max_document_chars),
            *quality_filters(config, preset),
            ExactDedupInMemoryFilter(),
            JsonlWriter(str(out / "heldout"), output_filename="${rank}.jsonl.gz"),
        ]
        stages.append(("heldout", attach_samples(held, out / "heldout_removed", config.removed_samples), 1))
    return stages


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and Slurm set)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stage_workers(config, tasks: int) -> int:
    """Tasks of a stage run at once: `workers`, or (unset) this machine's cores for the local
    executor and every task for the cluster ones; never more than the stage's tasks."""
    if config.workers is not None:
        return min(config.workers, tasks)
    return min(machine_cores(), tasks) if config.executor == "local" else tasks


def make_executors(config: CurationConfig, stages: list[tuple[str, list, int]], logs: Path) -> list:
    """One datatrove executor per stage, each depending on the previous one. `config` is any
    section with `executor`, `workers`, `slurm` and `ray` (curation, tokenization)."""
    executors: list = []
    previous = None
    for name, pipeline, tasks in stages:
        workers = stage_workers(config, tasks)
        logging_dir = str(logs / name)
        if config.executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            ex = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, depends=previous
            )
        elif config.executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            if config.slurm is None:
                section = {"CurationConfig": "curation", "TokenizeConfig": "tokenize"}.get(
                    type(config).__name__, type(config).__name__
                )
                raise ValueError(
                    f"{section}.executor is slurm but {section}.slurm is not set; add a slurm section with at least partition"
                )
            s = config.slurm
            ex = SlurmPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=workers,
                time=s.time,
                partition=s.partition,
                cpus_per_task=s.cpus_per_task,
                mem_per_cpu_gb=s.mem_per_cpu_gb,
                qos=s.qos,
                venv_path=s.venv_path,
                sbatch_args=dict(s.sbatch_args),
                job_name=f"curate-{name}",
                logging_dir=logging_dir,
                depends=previous,
            )
        else:
            from datatrove.executor import RayPipelineExecutor

            ex = RayPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=workers,
                logging_dir=logging_dir,
                depends=previous,
                cpus_per_task=config.ray.cpus_per_task,
                mem_per_cpu_gb=config.ray.mem_per_cpu_gb,
            )
        executors.append(ex)
        previous = ex
    return executors


def run_executors(config: CurationConfig, executors: list, logs: Path) -> None:
    """Run the chain; the local executor runs in-process stage by stage, clusters are awaited."""
    if config.executor == "local":
        for ex in executors:
            ex.run()
        return
    executors[-1].run()  # launches its dependencies first (slurm: sbatch with afterok)
    if config.executor == "slurm":
        from infra.launchers.slurm import wait_for_datatrove

        # polls the array jobs too: a failed stage raises (and cancels the chain) instead of
        # leaving its afterok dependents pending forever
        wait_for_datatrove(executors, config.slurm.poll_seconds if config.slurm else 60.0)


# --- statistics -------------------------------------------------------------------------------


def _chars(stats: dict[str, Any]) -> int | None:
    doc_len = stats.get("doc_len")
    return int(doc_len["total"]) if isinstance(doc_len, dict) else None


def read_stage_stats(logs: Path, stage: str) -> list[dict[str, Any]]:
    path = logs / stage / "stats.json"
    if not path.is_file():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def filter_rows(logs: Path, stages: list[tuple[str, list, int]]) -> list[dict[str, Any]]:
    """Per-filter rows (docs and chars in and out, drop reasons) from the stages' stats.json.

    The first row is the reader of the first stage's input (its drops are unreadable or
    rejected lines); then every filter and dedup filter in pipeline order.
    """
    from datatrove.pipeline.filters.base_filter import BaseFilter

    from curation.filters import filter_name
    from curation.io import CountingJsonlReader

    rows: list[dict[str, Any]] = []
    for index, (stage, pipeline, _) in enumerate(stages):
        steps = read_stage_stats(logs, stage)
        if not steps:
            continue
        chars_in: int | None = None
        docs_in: int | None = None
        for position, (component, entry) in enumerate(zip(pipeline, steps, strict=False)):
            stats = entry.get("stats", {})
            if isinstance(component, CountingJsonlReader):
                read = (
                    int(stats.get("documents", {}).get("total", 0)) if isinstance(stats.get("documents"), dict) else 0
                )
                chars_in = _chars(stats) or 0
                docs_in = read
                if index == 0:
                    reasons = {k[len("rejected_") :]: int(v) for k, v in stats.items() if k.startswith("rejected_")}
                    rows.append(
                        {
                            "stage": stage,
                            "position": position,
                            "filter": "read",
                            "docs_in": read + sum(reasons.values()),
                            "docs_out": read,
                            "chars_in": chars_in,
                            "chars_out": chars_in,
                            "reasons": reasons,
                        }
                    )
                continue
            if not (isinstance(component, BaseFilter) or "total" in stats and "forwarded" in stats):
                continue
            total = int(stats.get("total", docs_in or 0))
            out = int(stats.get("forwarded", 0))
            chars_out = _chars(stats)
            if chars_out is None:  # dedup filters keep no doc_len: take it from the next writer
                nxt = steps[position + 1]["stats"] if position + 1 < len(steps) else {}
                chars_out = _chars(nxt) or 0
            reasons = {k[len("dropped_") :]: int(v) for k, v in stats.items() if k.startswith("dropped_")}
            dropped = int(stats.get("dropped", total - out))
            if dropped and not reasons:
                reasons = {filter_name(component): dropped}
            rows.append(
                {
                    "stage": stage,
                    "position": position,
                    "filter": filter_name(component),
                    "docs_in": total,
                    "docs_out": out,
                    "chars_in": chars_in or 0,
                    "chars_out": chars_out,
                    "reasons": reasons,
                }
            )
            docs_in, chars_in = out, chars_out
    for i, row in enumerate(rows):
        row["position"] = i
    return rows


def _removed(rows: list[dict[str, Any]]) -> Counter[str]:
    """`<filter>:<reason>` -> documents, over every row but the reader's."""
    removed = Counter[str]()
    for row in rows:
        if row["filter"] != "read":
            for reason, n in row["reasons"].items():
                removed[f"{row['filter']}:{reason}"] += n
    return removed


# --- the step ---------------------------------------------------------------------------------


def shard_count(folder: Path) -> int:
    return len(list(folder.glob("*.jsonl.gz")))


def _has_lines(folder: Path) -> bool:
    import gzip

    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rb") as fh:
            if any(line.strip() for line in fh):
                return True
    return False


def heldout_documents(corpora: Sequence[Artifact], config: CurationConfig) -> Iterator[tuple[str, str]]:
    """(source/id, text) of every held-out document of the corpora, as their sources wrote them
    and, where the source's preset rewrites text (`docs`: prose only), also as curation keeps it:
    the eval suite's items come from that form, and rewriting changes the n-grams (links and
    inline markup unwrapped, code dropped) so that the written form alone misses copies of it."""
    from curation.filters import DocumentationProseFilter, prose_text
    from tasks.sources import read_shards

    for art in corpora:
        folder = art.path / "heldout"
        if folder.is_dir():
            source = art.meta.get("source", art.short)
            preset = config.preset_for(source, art.meta.get("domain", "web"), art.meta.get("language", "en"))
            rewrites = any(isinstance(f, DocumentationProseFilter) for f in PRESETS.get(preset)(config))
            for doc in read_shards(folder):
                yield f"{source}/{doc['id']}", doc["text"]
                kept = prose_text(doc["text"]) if rewrites else ""
                if kept and kept != doc["text"]:
                    yield f"{source}/{doc['id']}", kept


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The per-filter table as Markdown (documents and characters in and out, reasons)."""
    lines = ["| filter | docs in | docs out | chars in | chars out | reasons |", "|---|---|---|---|---|---|"]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['filter']} | {r['docs_in']} | {r['docs_out']} | {r['chars_in']:,} | {r['chars_out']:,} | {reasons} |"
        )
    return "\n".join(lines)


def publish_curated(artifact: Artifact, ws, label: str) -> None:
    """Filter statistics to lineage (`filter_stats`) and to a Prefect table artifact."""
    from prefect.artifacts import create_table_artifact

    rows = json.loads((artifact.path / "filter_stats.json").read_text(encoding="utf-8"))
    source = artifact.meta.get("source", label)
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
    from curation.heldout import HeldoutIndex

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
    index_path, against = None, [corpus, *(o for o in others if o.fingerprint != corpus.fingerprint)]
    if config.decontamination.enabled:
        index = HeldoutIndex.build(heldout_documents(against, config), config.decontamination.ngram)
        if len(index):
            (out / "work").mkdir(parents=True, exist_ok=True)
            index_path = out / "work" / "heldout_index.npz"
            index.save(index_path)
    has_heldout = heldout.is_dir() and _has_lines(heldout)
    stages = plan_stages(config, preset, train, out, tasks, heldout=heldout if has_heldout else None, index=index_path)
    train_stages = [s for s in stages if s[0] != "heldout"]
    held_stages = [s for s in stages if s[0] == "heldout"]
    run_executors(config, make_executors(config, stages, logs), logs)
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
    removed, held_removed = _removed(rows), _removed(held_rows)
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
        "decontaminated_against": (sorted({a.meta.get("source", a.short) for a in against}) if index_path else []),
        # what this step dropped, each document once (the source step's rejections stay in
        # the source's meta): unreadable lines of either split, train removals, held-out removals
        "rejected": dict(rejected),
        "removed": dict(removed),
        "heldout_removed": dict(held_removed),
        "unaccounted": unaccounted,
        "seconds": round(seconds, 2),
        "executor": config.executor,
        "tasks": tasks,
    }
