"""Curation: one datatrove pipeline per source turns a corpus artifact into a curated corpus.

Stages (each a datatrove executor run whose logs and `stats.json` stay in the step folder):

    filter   read train shards (counting unreadable lines) -> [language] -> domain preset filters
             -> write `filtered/` -> exact-dedup signatures
    exact    find exact duplicates (datatrove ExactFindDedups)
    unique   read `filtered/` -> drop exact duplicates -> write `unique/` -> MinHash signatures
    buckets  MinHash buckets;   cluster  MinHash clusters
    final    read `unique/` -> drop near duplicates -> write `train/` (the curated corpus)

Design choices:
- Presets per domain are lists of datatrove filters (a registry refuses duplicates): `web` is the
  FineWeb stack (Gopher repetition and quality, C4, FineWeb quality), `code` is the heuristics in
  this file that suit source code, `math` is light (length only). The English filters need spaCy's
  tokenizer only: datatrove builds it with `spacy.blank("en")`, so nothing is downloaded.
- Bad input is counted, never dropped silently: the reader counts malformed JSON, invalid UTF-8,
  missing or non-string text, empty and too large documents per reason; every filter's drops
  are counted per reason by datatrove; a few removed documents per filter and reason are kept in
  `removed/` for inspection.
- Dedup stages read their input rank by rank (`{rank:05d}.jsonl.gz`) because datatrove's MinHash
  and exact-dedup filters address documents by their index within a rank's stream.
- The executor is datatrove's LocalPipelineExecutor by default; `slurm` and `ray` build datatrove's
  Slurm/Ray executors chained by `depends`, for clusters.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from pydantic import BaseModel, ConfigDict, Field

from infra.artifact import Artifact
from infra.registry import Registry
from tasks.step import step

READ_REASONS = ("malformed_json", "invalid_utf8", "missing_text_field", "empty", "too_large")


class SlurmConfig(BaseModel):
    """Where curation runs on a Slurm cluster (datatrove SlurmPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: str  # Slurm partition to submit to
    time: str = "24:00:00"  # wall-clock limit of each array job
    cpus_per_task: int = Field(default=1, gt=0)  # CPUs per datatrove task
    mem_per_cpu_gb: int = Field(default=2, gt=0)  # memory per CPU
    qos: str = "normal"  # Slurm quality of service
    venv_path: str | None = None  # activate this virtualenv in the jobs (else the submitting env)
    sbatch_args: dict[str, str] = {}  # extra `#SBATCH` options, e.g. {"account": "lm"}
    poll_seconds: float = Field(default=60.0, gt=0)  # how often to check for finished tasks


class RayConfig(BaseModel):
    """Where curation runs on a Ray cluster (datatrove RayPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus_per_task: int = Field(default=1, gt=0)  # CPUs reserved per datatrove task
    mem_per_cpu_gb: float = Field(default=2.0, gt=0)  # memory reserved per CPU


class CurationConfig(BaseModel):
    """The recipe's `curation` section: filters, dedup and where the pipelines run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    executor: Literal["local", "slurm", "ray"] = "local"  # datatrove executor kind
    tasks: int = Field(default=1, gt=0)  # datatrove tasks (capped by the number of input shards)
    workers: int = Field(default=1, gt=0)  # tasks run at once (local: processes)
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
    language_model: str | None = None  # local fastText LID model (lid.176.bin); no download
    languages: tuple[str, ...] = ("en",)  # languages kept when language_model is set
    language_threshold: float = Field(default=0.65, ge=0, le=1)  # minimum LID score to keep
    removed_samples: int = Field(default=20, ge=0)  # removed documents kept per filter and reason
    slurm: SlurmConfig | None = None  # required when executor is slurm
    ray: RayConfig = RayConfig()  # used when executor is ray


# --- reading with accounting ------------------------------------------------------------------


class CountingJsonlReader(JsonlReader):
    """datatrove's JsonlReader, but every line that does not become a document is counted.

    The stock reader logs malformed lines and skips documents without text; here each such line
    becomes a `rejected_{reason}` statistic with a few example locations, so nothing vanishes.
    With `rank_files`, rank r reads exactly `{r:05d}.jsonl.gz` (the dedup stages need the same
    per-rank document order as the stage that computed their signatures).
    """

    name = "🐿 Jsonl (counted)"

    def __init__(self, data_folder, *, max_chars: int = 1_000_000, rank_files: bool = False, **kw):
        super().__init__(data_folder, compression="gzip", glob_pattern="*.jsonl.gz", **kw)
        self.max_chars = max_chars
        self.rank_files = rank_files

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        if not self.rank_files:
            yield from super().run(data, rank, world_size)
            return
        name = f"{rank:05d}.jsonl.gz"
        if self.data_folder.exists(name):
            for doc in self.read_files_shard([name]):
                self.update_doc_stats(doc)
                yield doc

    def _reject(self, reason: str, where: str) -> None:
        self.stat_update(f"rejected_{reason}")
        self.stat_update("rejected")
        self._examples = getattr(self, "_examples", Counter())
        self._examples[reason] += 1
        if self._examples[reason] <= 5:  # a few locations per reason, in the stage's task log
            from datatrove.utils.logging import logger

            logger.warning(f"rejected line ({reason}) at {where}")

    def read_file(self, filepath: str):
        import orjson

        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            for li, raw in enumerate(f):
                if not raw.strip():
                    continue
                where = f"{filepath}:{li + 1}"
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    # orjson validates UTF-8 itself, and refuses lone surrogates (\ud800): text
                    # that could not be written back as UTF-8
                    bad_text = "UTF-8" in str(exc) or "surrogate" in str(exc)
                    self._reject("invalid_utf8" if bad_text else "malformed_json", where)
                    continue
                if not isinstance(record, dict) or not isinstance(record.get(self.text_key), str):
                    self._reject("missing_text_field" if isinstance(record, dict) else "malformed_json", where)
                    continue
                text = record[self.text_key]
                if not text.strip():
                    self._reject("empty", where)
                    continue
                if len(text) > self.max_chars:
                    self._reject("too_large", where)
                    continue
                record.setdefault(self.id_key, where)
                document = self.get_document_from_dict(record, filepath, li)
                if document is not None:
                    yield document


class SampleWriter(JsonlWriter):
    """An exclusion writer that keeps at most `per_reason` removed documents per drop reason."""

    def __init__(self, output_folder, per_reason: int):
        super().__init__(output_folder, output_filename="${rank}.jsonl.gz")
        self.per_reason = per_reason
        self._seen: Counter[str] = Counter()

    def write(self, document: Document, rank: int = 0, **kwargs):
        reason = document.metadata.get("filter_reason", "duplicate")
        self._seen[reason] += 1
        if self._seen[reason] <= self.per_reason:
            super().write(document, rank, **kwargs)


# --- filters that suit code and math ----------------------------------------------------------


class CodeLineLengthFilter(BaseFilter):
    """Drops minified or data-like files: a very long line, or long lines on average."""

    name = "📏 Code line length"

    def __init__(self, max_line_length: int = 1000, max_mean_line_length: int = 100, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.max_line_length = max_line_length
        self.max_mean_line_length = max_mean_line_length

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        lengths = [len(line) for line in doc.text.splitlines()] or [0]
        if max(lengths) > self.max_line_length:
            return False, "max_line_length"
        if sum(lengths) / len(lengths) > self.max_mean_line_length:
            return False, "mean_line_length"
        return True


class AlphanumericFractionFilter(BaseFilter):
    """Drops files that are mostly symbols or binary-like blobs (The Stack's heuristic)."""

    name = "🔤 Alphanumeric fraction"

    def __init__(self, min_fraction: float = 0.25, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_fraction = min_fraction

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        alnum = sum(c.isalnum() for c in text)
        if alnum / max(len(text), 1) < self.min_fraction:
            return False, "alphanumeric_fraction"
        return True


_AUTOGENERATED = re.compile(
    r"auto-?generated|automatically generated|generated by|do not edit|code generator",
    re.IGNORECASE,
)


class AutogeneratedFilter(BaseFilter):
    """Drops files whose header says a tool generated them (lock files, protobuf stubs, ...)."""

    name = "🤖 Autogenerated"

    def __init__(self, header_lines: int = 5, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.header_lines = header_lines

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        header = "\n".join(doc.text.splitlines()[: self.header_lines])
        if _AUTOGENERATED.search(header):
            return False, "autogenerated"
        return True


class LengthFilter(BaseFilter):
    """Drops documents shorter than `min_chars` (too little text to teach anything)."""

    name = "📐 Length"

    def __init__(self, min_chars: int = 20, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_chars = min_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if len(doc.text.strip()) < self.min_chars:
            return False, "too_short"
        return True


# --- presets ----------------------------------------------------------------------------------

# A preset builds its filters given a factory of exclusion writers (one folder per filter).
Preset = Callable[[Callable[[str], Any]], list[BaseFilter]]
PRESETS: Registry[Preset] = Registry("curation preset")


@PRESETS.register("web")
def web_preset(excl: Callable[[str], Any]) -> list[BaseFilter]:
    """FineWeb's English heuristic stack with its published thresholds."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return [
        GopherRepetitionFilter(exclusion_writer=excl("gopher_repetition")),
        GopherQualityFilter(exclusion_writer=excl("gopher_quality")),
        # FineWeb keeps lines without terminal punctuation; C4's line rule removed too much
        C4QualityFilter(filter_no_terminal_punct=False, exclusion_writer=excl("c4_quality")),
        FineWebQualityFilter(exclusion_writer=excl("fineweb_quality")),
    ]


@PRESETS.register("code")
def code_preset(excl: Callable[[str], Any]) -> list[BaseFilter]:
    """Heuristics that suit source code (English prose filters would drop most of it)."""
    return [
        CodeLineLengthFilter(exclusion_writer=excl("code_line_length")),
        AlphanumericFractionFilter(exclusion_writer=excl("alphanumeric_fraction")),
        AutogeneratedFilter(exclusion_writer=excl("autogenerated")),
    ]


@PRESETS.register("math")
def math_preset(excl: Callable[[str], Any]) -> list[BaseFilter]:
    """Light: math text is symbol-heavy, so prose heuristics misfire; keep only a length floor."""
    return [LengthFilter(min_chars=20, exclusion_writer=excl("length"))]


@PRESETS.register("none")
def no_preset(excl: Callable[[str], Any]) -> list[BaseFilter]:
    """No quality filters (dedup and input accounting still apply)."""
    return []


def exact_text(doc: Document) -> str:
    """What exact dedup compares: the text without surrounding whitespace."""
    return doc.text.strip()


# --- pipelines and executors ------------------------------------------------------------------


def language_filter(config: CurationConfig, excl: Callable[[str], Any]) -> BaseFilter:
    """datatrove's LanguageFilter reading a local fastText model instead of downloading one."""
    from datatrove.pipeline.filters import LanguageFilter
    from datatrove.utils.lid import FastTextLID

    path = Path(config.language_model or "").expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"curation.language_model {config.language_model!r} is not a file; give the path of "
            "a local fastText language-id model (e.g. lid.176.bin) or remove the setting"
        )

    class LocalLID(FastTextLID):
        @property
        def model(self):
            if self._model is None:
                from fasttext.FastText import _FastText

                self._model = _FastText(str(path))
            return self._model

    lid = LanguageFilter(
        languages=list(config.languages),
        language_threshold=config.language_threshold,
        exclusion_writer=excl("language"),
    )
    lid.model = LocalLID(list(config.languages))
    return lid


def plan_stages(
    config: CurationConfig, preset: str, train: Path, out: Path, tasks: int
) -> list[tuple[str, list, int]]:
    """The curation stages as (name, datatrove pipeline, tasks), in order."""
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
    from datatrove.utils.hashing import HashConfig

    def excl(name: str) -> SampleWriter | None:
        if config.removed_samples == 0:
            return None
        return SampleWriter(str(out / "removed" / name), config.removed_samples)

    filters: list[BaseFilter] = []
    if config.language_model:
        filters.append(language_filter(config, excl))
    filters += PRESETS.get(preset)(excl)
    read = CountingJsonlReader(str(train), max_chars=config.max_document_chars)
    exact_cfg = ExactDedupConfig(content_getter=exact_text, hash_config=HashConfig(precision=64))
    mh_cfg = MinhashConfig(
        n_grams=config.minhash_ngrams,
        num_buckets=config.minhash_buckets,
        hashes_per_bucket=config.minhash_hashes_per_bucket,
        hash_config=HashConfig(precision=64),
    )
    final = str(out / "train")
    filtered = final if not (config.exact_dedup or config.minhash) else str(out / "work" / "filtered")
    stages: list[tuple[str, list, int]] = []
    first = [read, *filters, JsonlWriter(filtered, output_filename="${rank}.jsonl.gz")]
    if config.exact_dedup:
        first.append(ExactDedupSignature(str(out / "work" / "exact_sigs"), config=exact_cfg))
    stages.append(("filter", first, tasks))
    current = filtered
    if config.exact_dedup:
        unique = final if not config.minhash else str(out / "work" / "unique")
        stages.append(
            ("exact", [ExactFindDedups(str(out / "work" / "exact_sigs"), str(out / "work" / "exact_dups"), config=exact_cfg)], 1)
        )
        second = [
            CountingJsonlReader(current, rank_files=True),
            ExactDedupFilter(str(out / "work" / "exact_dups"), config=exact_cfg, exclusion_writer=excl("exact_dedup")),
            JsonlWriter(unique, output_filename="${rank}.jsonl.gz"),
        ]
        if config.minhash:
            second.append(MinhashDedupSignature(str(out / "work" / "minhash_sigs"), config=mh_cfg))
        stages.append(("unique", second, tasks))
        current = unique
    elif config.minhash:
        stages.append(
            ("signatures", [CountingJsonlReader(current, rank_files=True), MinhashDedupSignature(str(out / "work" / "minhash_sigs"), config=mh_cfg)], tasks)
        )
    if config.minhash:
        stages.append(
            ("buckets", [MinhashDedupBuckets(str(out / "work" / "minhash_sigs"), str(out / "work" / "minhash_buckets"), config=mh_cfg)], config.minhash_buckets)
        )
        stages.append(
            ("cluster", [MinhashDedupCluster(str(out / "work" / "minhash_buckets"), str(out / "work" / "minhash_remove"), config=mh_cfg)], 1)
        )
        stages.append(
            (
                "final",
                [
                    CountingJsonlReader(current, rank_files=True),
                    MinhashDedupFilter(str(out / "work" / "minhash_remove"), exclusion_writer=excl("minhash_dedup")),
                    JsonlWriter(final, output_filename="${rank}.jsonl.gz"),
                ],
                tasks,
            )
        )
    return stages


def make_executors(config: CurationConfig, stages: list[tuple[str, list, int]], logs: Path) -> list:
    """One datatrove executor per stage, each depending on the previous one."""
    executors: list = []
    previous = None
    for name, pipeline, tasks in stages:
        workers = min(config.workers, tasks)
        logging_dir = str(logs / name)
        if config.executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            ex = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, depends=previous
            )
        elif config.executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            if config.slurm is None:
                raise ValueError("curation.executor is slurm but curation.slurm is not set; add a slurm section with at least partition")
            s = config.slurm
            ex = SlurmPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, time=s.time, partition=s.partition,
                cpus_per_task=s.cpus_per_task, mem_per_cpu_gb=s.mem_per_cpu_gb, qos=s.qos,
                venv_path=s.venv_path, sbatch_args=dict(s.sbatch_args), job_name=f"curate-{name}",
                logging_dir=logging_dir, depends=previous,
            )
        else:
            from datatrove.executor import RayPipelineExecutor

            ex = RayPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, depends=previous,
                cpus_per_task=config.ray.cpus_per_task, mem_per_cpu_gb=config.ray.mem_per_cpu_gb,
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
        poll = config.slurm.poll_seconds if config.slurm else 60.0
        while executors[-1].get_incomplete_ranks():
            time.sleep(poll)


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

    The first row is the reader of the input (its drops are unreadable or rejected lines); then
    every filter and dedup filter in pipeline order.
    """
    rows: list[dict[str, Any]] = []
    for stage, pipeline, _ in stages:
        steps = read_stage_stats(logs, stage)
        if not steps:
            continue
        chars_in: int | None = None
        docs_in: int | None = None
        for position, (component, entry) in enumerate(zip(pipeline, steps, strict=False)):
            stats = entry.get("stats", {})
            if isinstance(component, CountingJsonlReader):
                read = int(stats.get("documents", {}).get("total", 0)) if isinstance(stats.get("documents"), dict) else 0
                chars_in = _chars(stats) or 0
                docs_in = read
                if stage == "filter":
                    reasons = {k[len("rejected_"):]: int(v) for k, v in stats.items() if k.startswith("rejected_")}
                    rows.append(
                        {"stage": stage, "position": position, "filter": "read", "docs_in": read + sum(reasons.values()),
                         "docs_out": read, "chars_in": chars_in, "chars_out": chars_in, "reasons": reasons}
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
            reasons = {k[len("dropped_"):]: int(v) for k, v in stats.items() if k.startswith("dropped_")}
            dropped = int(stats.get("dropped", total - out))
            if dropped and not reasons:
                reasons = {_slug(component): dropped}
            rows.append(
                {"stage": stage, "position": position, "filter": _slug(component), "docs_in": total,
                 "docs_out": out, "chars_in": chars_in or 0, "chars_out": chars_out, "reasons": reasons}
            )
            docs_in, chars_in = out, chars_out
    for i, row in enumerate(rows):
        row["position"] = i
    return rows


def _slug(component: Any) -> str:
    """A stable snake_case name for a pipeline component (GopherQualityFilter -> gopher_quality)."""
    name = type(component).__name__
    for suffix in ("Filter",):
        if name.endswith(suffix) and name != suffix:
            name = name[: -len(suffix)]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# --- the build function -----------------------------------------------------------------------


def shard_count(folder: Path) -> int:
    return len(list(folder.glob("*.jsonl.gz")))


def build_curated(config: CurationConfig, corpus: Artifact, out: Path, log=print) -> dict[str, Any]:
    """Curate one corpus artifact into `out/train` (+ `out/heldout` copied as is); return meta."""
    source = corpus.meta.get("source", corpus.short)
    domain = corpus.meta.get("domain", "web")
    if corpus.meta.get("format", "jsonl") != "jsonl":
        raise ValueError(
            f"curation of source {source!r}: reads gzip JSONL shards, but the corpus is "
            f"{corpus.meta.get('format')}; set output_format: jsonl on that source"
        )
    preset = config.presets.get(source, domain)
    if source in config.minhash_skip:
        config = config.model_copy(update={"minhash": False})
    PRESETS.get(preset)  # unknown preset names fail here, naming the allowed ones
    train = corpus.path / "train"
    tasks = max(1, min(config.tasks, shard_count(train)))
    logs = out / "logs"
    stages = plan_stages(config, preset, train, out, tasks)
    executors = make_executors(config, stages, logs)
    start = time.monotonic()
    run_executors(config, executors, logs)
    seconds = time.monotonic() - start
    rows = filter_rows(logs, stages)
    (out / "train").mkdir(exist_ok=True)
    heldout = corpus.path / "heldout"
    if heldout.is_dir():
        # held-out text is for evaluation (fertility, loss): keep it as the source wrote it
        shutil.copytree(heldout, out / "heldout", dirs_exist_ok=True)
    if (out / "work").exists():
        shutil.rmtree(out / "work")
    # the last row's output is what the final writer wrote (no second read of the corpus)
    documents, characters = (rows[-1]["docs_out"], rows[-1]["chars_out"]) if rows else (0, 0)
    read_rejected = rows[0]["reasons"] if rows and rows[0]["filter"] == "read" else {}
    removed = Counter[str]()
    for row in rows:
        if row["filter"] == "read":
            continue
        for reason, n in row["reasons"].items():
            removed[f"{row['filter']}:{reason}"] += n
    docs_in = rows[0]["docs_in"] if rows else 0
    accounted = documents + sum(read_rejected.values()) + sum(removed.values())
    if accounted != docs_in:
        # every input line must end kept, rejected or removed; anything else is a bug to see
        log(f"curate {source}: {docs_in} lines in but {accounted} accounted for")
    (out / "filter_stats.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    log(
        f"curate {source} ({preset}): {docs_in} in -> {documents} kept "
        f"({characters} chars) in {seconds:.1f}s; rejected {dict(read_rejected)}"
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
        "preset": preset,
        "format": "jsonl",
        "documents": documents,
        "characters": characters,
        "input_documents": docs_in,
        "heldout_documents": corpus.meta.get("heldout_documents", 0),
        "heldout_characters": corpus.meta.get("heldout_characters", 0),
        "rejected": {**corpus.meta.get("rejected", {}), **{f"curate:{k}": v for k, v in read_rejected.items()}},
        "removed": dict(removed),
        "unaccounted": docs_in - accounted,
        "seconds": round(seconds, 2),
        "executor": config.executor,
        "tasks": tasks,
    }


def publish_curated(artifact: Artifact, ws, label: str) -> None:
    """Filter statistics to lineage (`filter_stats`) and to a Prefect table artifact."""
    from prefect.artifacts import create_table_artifact

    rows = json.loads((artifact.path / "filter_stats.json").read_text(encoding="utf-8"))
    source = artifact.meta.get("source", label)
    ws.lineage().record_rows(
        "filter_stats",
        [
            (artifact.fingerprint, source, r["position"], r["filter"], r["docs_in"], r["docs_out"],
             r["chars_in"], r["chars_out"], json.dumps(r["reasons"], sort_keys=True))
            for r in rows
        ],
    )
    table = [
        {**{k: r[k] for k in ("filter", "docs_in", "docs_out", "chars_in", "chars_out")},
         "reasons": ", ".join(f"{k}={v}" for k, v in sorted(r["reasons"].items()))}
        for r in rows
    ]
    create_table_artifact(
        table=table,
        key=f"curate-{re.sub(r'[^a-z0-9-]', '-', source.lower())}",
        description=f"Curation of {source}: documents and characters per filter, removal reasons",
    )


@step("curate", version=1, kind="corpus", publish=publish_curated)
def curate(config: CurationConfig, inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Prefect task: one source's corpus artifact to a curated corpus artifact."""
    (corpus,) = inputs
    return build_curated(config, corpus, out, log)
