"""The data-source kinds: what reads a recipe source's records, behind a registry that refuses duplicates.

A source is named in the recipe by a URI:

    builtin:prose   English prose that exists on any Python install: `pydoc` topics, the long
                    descriptions of the installed distributions, standard-library docstrings
    builtin:code    standard-library Python source files
    builtin:math    generated arithmetic and word problems with worked answers (seeded)
    files:GLOB      local JSONL (.jsonl, .json, .jsonl.gz) or Parquet files; `text_field` names
                    the text column
    hf:NAME         a Hugging Face dataset from the hub (`hf_subset`, `hf_split`, `hf_revision`)
    hf:/PATH        a dataset folder written by `datasets.save_to_disk`

The source step (tasks/sources.py, read as datatrove tasks by curation/ingest.py: each task its
part, `SourceKind.task_records`) writes `train/` and `heldout/` shards (`ShardWriter`; `read_shards` reads them back) (gzip JSONL with `id`, `text`, `metadata`
as datatrove's readers expect, or Parquet) and returns counts in the artifact. The held-out split
is chosen by a stable hash of each document's id (the same on every machine); copies of a
held-out document under other ids land in train here, and curation removes them
(tasks/curate.py, decontamination). Bad input never crashes the step and is never dropped
silently: every rejected record is counted under its reason (malformed_json, invalid_utf8,
missing_text_field, empty, too_large, duplicate_id) with a few example locations.

`check_sources` finds the configuration mistakes that would otherwise surface only inside the
step (a glob that matches nothing, a text field the files do not have) in milliseconds: it
reads a Parquet schema or the first records of a file, never a whole file. Hub datasets are not
checked (that needs the network).
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import gzip
import hashlib
import importlib.metadata
import itertools
import json
import os
import random
import re
import sysconfig
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.home import HOME_ENV, from_base, project_base
from infra.registry import Registry

Domain = Literal["web", "code", "math"]


class SourceConfig(BaseModel):
    """One data source of the recipe."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # identifier used in mixtures and lineage; `/` and capitals allowed so published mixtures
    # keep their names (fineweb-edu/fineweb-edu, stack-edu-Python)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")
    uri: str  # where the text comes from (see the module docstring for the schemes)
    domain: Domain  # selects the curation preset: web, code or math
    # language of the text (ISO 639-1, curation/languages.py): web sources get the preset of
    # their language (`web-fr`: language ID keeping French, French stop words and thresholds)
    language: str = "en"
    text_field: str = "text"  # field holding the text in files: and hf: sources
    id_field: str | None = None  # field holding a stable id; default: file and line number
    max_documents: int | None = Field(default=None, gt=0)  # cap (and the count for builtin:math)
    # builtin:math only: the largest operand of the generated problems (e.g. 9: docs/posttraining.md);
    # None: the generator's ranges (sums of up to 999, products of up to 99 x 99). Out of the
    # fingerprint while None (an added identity field, pipeline/artifact.py `added_identity`), so
    # recipes without it keep their folders.
    max_operand: int | None = Field(default=None, ge=3, json_schema_extra={"identity_unless_default": True})
    held_out_fraction: float = Field(default=0.05, ge=0.0, lt=0.5)  # share kept for evaluation
    max_document_chars: int = Field(default=1_000_000, gt=0)  # longer documents are rejected
    output_format: Literal["jsonl", "parquet"] = "jsonl"  # shard format of the corpus
    documents_per_shard: int = Field(default=5000, gt=0)  # documents per output shard, at most
    # the train split is dealt round robin into at least this many shards, so curation and
    # tokenization (one datatrove task per shard at most) can use that many cores or tasks
    shards: int = Field(default=8, gt=0)
    hf_subset: str | None = None  # dataset configuration name (hub only)
    hf_split: str = "train"  # split to read
    hf_revision: str | None = None  # pinned dataset revision (hub only); pin it for caching

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        resolve_kind(uri)
        return uri

    @model_validator(mode="after")
    def _operands_of_generated_math(self) -> SourceConfig:
        if self.max_operand is not None and self.uri != "builtin:math":
            raise ValueError(
                f"source {self.name}: max_operand sets the generated problems of builtin:math, not of {self.uri}"
            )
        return self

    @field_validator("language")
    @classmethod
    def _language_code(cls, language: str) -> str:
        # A code without a web preset is the recipe's to refuse (flows/recipe.py): there the
        # source's preset is known, and `curation.presets.NAME=none` curates it without one.
        if not re.fullmatch(r"[a-z]{2,3}", language):
            raise ValueError(f"{language!r} is not a language code (ISO 639-1, e.g. fr, or 639-3)")
        return language


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    reason: str  # malformed_json | invalid_utf8 | missing_text_field | empty | too_large | blank_line
    where: str  # file:line or record index, so the user can look
    fields: tuple[str, ...] = ()  # missing_text_field: the fields the record has
    count: int = 1  # records this stands for (a Parquet file without the text column: all rows)


class SourceKind(ABC):
    """Base class of a source kind: yields Documents (and Rejected records) in a stable order."""

    seeded = False  # whether the text depends on the recipe seed (generated data)
    parallel = False  # whether several tasks may read it (`max_tasks`, `task_records`)

    def __init__(self, config: SourceConfig, seed: int):
        self.config = config
        self.seed = seed

    def state(self) -> str:
        """A digest of what the text comes from, so changed inputs change the fingerprint."""
        return ""

    @abstractmethod
    def records(self) -> Iterator[Document | Rejected]:
        """Every record of the source, in a stable order."""

    def max_tasks(self, requested: int) -> int:
        """How many tasks may read this source at once (`task_records`), at most `requested`:
        the built-in kinds are laptop-sized and read by one task."""
        return 1

    def task_records(self, rank: int, world: int) -> Iterator[Document | Rejected]:
        """The records task `rank` of `world` reads: every record in exactly one task, a task's
        records in read order and the tasks' parts in read order (task 0 reads first)."""
        if world != 1:
            raise ValueError(f"{self.where}: {type(self).__name__} is read by one task, not {world}")
        return self.records()

    def check(self) -> list[str]:
        """Mistakes in the source's configuration that would fail the run, found cheaply
        (no full read): each names the field at fault (`sources[NAME].uri`) and the fix."""
        return []

    def missing(self) -> str | None:
        """Why the source's data is not on this machine (a glob matching nothing, a folder that
        does not exist), else None: a dry run plans around it instead of failing."""
        return None

    def is_readable(self) -> bool:
        """Whether its documents can be read here without the network (hub datasets cannot)."""
        return self.missing() is None

    @property
    def where(self) -> str:
        return f"sources[{self.config.name}]"


SOURCE_KINDS: Registry[type[SourceKind]] = Registry("source kind")


def resolve_kind(uri: str) -> type[SourceKind]:
    """The source kind for a URI: an exact name (builtin:prose) or a scheme prefix (files:...)."""
    if uri in SOURCE_KINDS:
        return SOURCE_KINDS.get(uri)
    scheme = uri.split(":", 1)[0] + ":" if ":" in uri else ""
    if scheme and scheme in SOURCE_KINDS and uri != scheme:
        return SOURCE_KINDS.get(scheme)
    raise ValueError(
        f"unknown source uri {uri!r}; allowed: {', '.join(SOURCE_KINDS.names())} "
        "(files: and hf: take a glob, dataset name or folder after the colon)"
    )


# The project's own distribution is not "installed text": its description is this repo's README,
# which changes with every docs edit and would retrain everything.
_OWN_DISTRIBUTIONS = {"smollm3-pipeline"}


def site_distributions() -> list[importlib.metadata.Distribution]:
    """Installed distributions of this interpreter, one per name, in name order.

    Read from the interpreter's site-packages folders only, never from `sys.path`: `sys.path`
    differs between the console script, `python -m`, a served flow run and another cwd (the
    repo's own `.egg-info` is seen from the repo root only), and a source must read, and
    fingerprint, the same text from every process.
    """
    paths = sysconfig.get_paths()
    folders = list(dict.fromkeys(str(Path(paths[k]).resolve()) for k in ("purelib", "platlib")))
    by_name: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=folders):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in _OWN_DISTRIBUTIONS:
            by_name.setdefault(name, dist)
    return [by_name[n] for n in sorted(by_name)]


def _digest_texts(parts: Iterator[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) of everything a builtin source reads."""
    h = hashlib.sha256()
    for name, data in parts:
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def _file_parts(paths: list[Path]) -> Iterator[tuple[str, bytes]]:
    for p in paths:
        try:
            yield p.name, p.read_bytes()
        except OSError:
            yield p.name, b"<unreadable>"


def _metadata_parts(dists: list[importlib.metadata.Distribution]) -> Iterator[tuple[str, bytes]]:
    for dist in dists:
        yield dist.metadata["Name"], (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").encode()


@functools.cache
def _stdlib_digest() -> str:
    """Digest of every standard-library file the builtin sources read (once per process)."""
    return _digest_texts(_file_parts(_stdlib_files()))


def _stdlib_files() -> list[Path]:
    """Every `*.py` under the standard library outside the skipped folders, sorted: the same list
    as `sorted(root.rglob("*.py"))` filtered by `skip`, without walking site-packages (thousands
    of files; 0.76 s against 0.02 s on the dev machine, which every `smollm3 plan` paid)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):  # like rglob: symlinked folders are not entered
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder, name) for name in (*files, *dirs) if fnmatch.fnmatchcase(name, "*.py")]
    return sorted(found)


@SOURCE_KINDS.register("builtin:prose")
class BuiltinProse(SourceKind):
    """English prose shipped with Python and the installed distributions."""

    def state(self) -> str:
        import pydoc_data.topics

        topics = Path(pydoc_data.topics.__file__)
        stdlib = [("stdlib", _stdlib_digest().encode())]
        return _digest_texts(itertools.chain(_file_parts([topics]), _metadata_parts(site_distributions()), stdlib))

    def records(self) -> Iterator[Document | Rejected]:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield Document(f"pydoc:{name}", topics[name].strip(), {"kind": "pydoc_topic"})
        for dist in site_distributions():
            name = dist.metadata["Name"]
            text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
            if len(text.strip()) >= 500:
                yield Document(f"dist:{name}", text.strip(), {"kind": "package_description"})
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in _stdlib_files():
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            parts = []
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 80:
                        parts.append(doc.strip())
            if parts:
                module = ".".join(path.relative_to(root).with_suffix("").parts)
                yield Document(f"docstring:{module}", "\n\n".join(parts), {"kind": "docstrings"})


@SOURCE_KINDS.register("builtin:code")
class BuiltinCode(SourceKind):
    """Standard-library Python source, one file per document."""

    def state(self) -> str:
        return _stdlib_digest()

    def records(self) -> Iterator[Document | Rejected]:
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in _stdlib_files():
            rel = path.relative_to(root).as_posix()
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                yield Rejected("invalid_utf8", rel)
                continue
            yield Document(f"stdlib:{rel}", text, {"kind": "python", "path": rel})


@SOURCE_KINDS.register("builtin:math")
class BuiltinMath(SourceKind):
    """Arithmetic and word problems with worked answers, deterministic per seed."""

    seeded = True

    def records(self) -> Iterator[Document | Rejected]:
        rng = random.Random(f"builtin:math:{self.seed}")
        for i in range(self.config.max_documents or 4000):
            problem, solution, answer = math_problem(rng, self.config.max_operand)
            text = f"Problem: {problem}\nSolution: {solution}\nAnswer: {answer}"
            yield Document(f"math:{self.seed}:{i}", text, {"kind": "math", "answer": answer})


_NAMES = ["Ada", "Ben", "Chloe", "Dev", "Elif", "Femi", "Grace", "Hugo", "Ines", "Jun"]
_ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "cookies", "cards", "shells"]


def operand_draw(rng: random.Random, max_operand: int | None):
    """`draw(lo, hi)`: a random operand in [lo, hi], or with `max_operand` one in
    [min(lo, 2), min(hi, max_operand)] (every operand small, whatever range the problem kind has)."""
    if max_operand is None:
        return rng.randint
    return lambda lo, hi: rng.randint(min(lo, 2), min(hi, max_operand))


def math_problem(rng: random.Random, max_operand: int | None = None) -> tuple[str, str, str]:
    """One problem, its worked solution and the final answer (a string of an integer). With
    `max_operand` (a source's `max_operand`) every operand is at most that (the same kinds and
    texts; division and sharing from the small times table); without it the same draws as ever."""
    draw = operand_draw(rng, max_operand)
    kind = rng.choice(["add", "sub", "mul", "div", "shop", "share", "speed", "multi"])
    a, b = draw(2, 999), draw(2, 999)
    if kind == "add":
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", str(a + b)
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}.", str(a - b)
    if kind == "mul":
        a, b = draw(2, 99), draw(2, 99)
        return f"What is {a} * {b}?", f"{a} * {b} = {a * b}.", str(a * b)
    if kind == "div":
        b, q = draw(2, 30), draw(2, 60)
        return f"What is {b * q} / {b}?", f"{b * q} / {b} = {q}.", str(q)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if kind == "shop":
        n, price = draw(2, 12), draw(2, 25)
        return (
            f"{name} buys {n} {item} at {price} dollars each. How many dollars does {name} spend?",
            f"Each costs {price} dollars, so {n} cost {n} * {price} = {n * price} dollars.",
            str(n * price),
        )
    if kind == "share":
        k, each = draw(2, 9), draw(2, 20)
        total = k * each
        return (
            f"{name} shares {total} {item} equally among {k} friends. How many does each friend get?",
            f"Each friend gets {total} / {k} = {each} {item}.",
            str(each),
        )
    if kind == "speed":
        v, t = draw(20, 120), draw(2, 9)
        return (
            f"A train travels at {v} km per hour for {t} hours. How many km does it travel?",
            f"Distance is speed times time: {v} * {t} = {v * t} km.",
            str(v * t),
        )
    have, more, gave = draw(5, 50), draw(5, 50), draw(1, 40)
    total = have + more
    gave = min(gave, total)
    return (
        f"{name} has {have} {item}, finds {more} more, then gives away {gave}. How many {item} does {name} have now?",
        f"{have} + {more} = {total}, and {total} - {gave} = {total - gave}.",
        str(total - gave),
    )


def _files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


_FILE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".parquet")
_CHECK_FILES = 8  # files whose fields check() reads (the first, in name order)
_CHECK_RECORDS = 20  # JSON lines read per file


def _parquet_fields(path: Path) -> dict[str, bool]:
    """Column -> whether it holds strings, from a Parquet file's footer only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    return {f.name: pa.types.is_string(f.type) or pa.types.is_large_string(f.type) for f in schema}


def _jsonl_fields(path: Path) -> dict[str, bool]:
    """Field -> whether any of its non-null values is a string, over the first records of a JSONL file."""
    opener = gzip.open if path.suffix == ".gz" else open
    fields: dict[str, bool] = {}
    parsed = 0
    with opener(path, "rb") as fh:
        for raw in itertools.islice((line for line in fh if line.strip()), _CHECK_RECORDS):
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                parsed += 1
                for k, v in record.items():
                    if v is not None:
                        fields[k] = fields.get(k, False) or isinstance(v, str)
    if not parsed:
        raise ValueError(f"none of its first {_CHECK_RECORDS} lines is a JSON object (JSON lines expected)")
    return fields


def _extract(record: Any, config: SourceConfig, where: str) -> Document | Rejected:
    if not isinstance(record, dict):
        return Rejected("malformed_json", where)
    text = record.get(config.text_field)
    if not isinstance(text, str):
        return Rejected("missing_text_field", where, tuple(record))
    doc_id = record.get(config.id_field) if config.id_field else None
    meta = {k: v for k, v in record.items() if k != config.text_field and _small(v)}
    return Document(str(doc_id) if doc_id is not None else where, text, meta)


def _small(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and len(str(value)) <= 200


def _not_text(where: str, field: str, path: Path | str, more: int = 0) -> str:
    return (
        f"{where}.text_field: {field!r} of {path}"
        + (f" (and of {more} more of the first {_CHECK_FILES} files)" if more else "")
        + " holds no strings (a struct, list or number column); every record would be rejected as "
        "missing_text_field: set text_field to the column that holds the text as a string"
    )


@SOURCE_KINDS.register("files:")
class LocalFiles(SourceKind):
    """JSONL or Parquet files matched by a glob (a relative glob is taken from $SMOLLM3_HOME, else
    the project root, as a relative workspace is: never from the current directory)."""

    def _paths(self) -> list[Path]:
        pattern = self.config.uri.split(":", 1)[1]
        full = from_base(pattern)
        anchor = Path(full.anchor)
        paths = [p for p in sorted(anchor.glob(str(full.relative_to(anchor)))) if p.is_file()]
        if not paths:
            relative = (
                ""
                if Path(pattern).expanduser().is_absolute()
                else f" (taken from {project_base()}: ${HOME_ENV}, else the project root)"
            )
            raise FileNotFoundError(
                f"{self.where}.uri: no files match {pattern!r}{relative}; fix the glob or give an absolute one"
            )
        return paths

    def check(self) -> list[str]:
        try:
            paths = self._paths()
        except FileNotFoundError as exc:
            return [str(exc)]
        other = [p for p in paths if not p.name.endswith(_FILE_SUFFIXES)]
        if other:
            return [
                f"{self.where}.uri: {len(other)} of the {len(paths)} matched files are not JSONL or "
                f"Parquet (e.g. {other[0]}); the files: scheme reads {', '.join(_FILE_SUFFIXES)}: narrow the glob"
            ]
        errors: list[str] = []
        lacking: dict[str, list[tuple[Path, set[str]]]] = defaultdict(list)
        not_text: list[Path] = []
        for path in paths[:_CHECK_FILES]:
            try:
                fields = _parquet_fields(path) if path.suffix == ".parquet" else _jsonl_fields(path)
            except (OSError, ValueError) as exc:
                errors.append(f"{self.where}.uri: cannot read {path}: {exc}")
                continue
            for key in ("text_field", "id_field"):
                field = getattr(self.config, key)
                if field is not None and field not in fields:
                    lacking[key].append((path, set(fields)))
            if fields.get(self.config.text_field) is False:  # present, but not strings
                not_text.append(path)
        for key, files in lacking.items():  # one error per field, however many files lack it
            (path, fields), more = files[0], len(files) - 1
            holds = "text" if key == "text_field" else "document id"
            errors.append(
                f"{self.where}.{key}: {getattr(self.config, key)!r} is not a field of {path}"
                + (f" (nor of {more} more of the first {_CHECK_FILES} files)" if more else "")
                + f" (fields: {', '.join(sorted(fields)) or 'none'}); set {key} to the field that holds the {holds}"
            )
        if not_text:
            errors.append(_not_text(self.where, self.config.text_field, not_text[0], len(not_text) - 1))
        return errors

    def missing(self) -> str | None:
        try:
            self._paths()
        except FileNotFoundError as exc:
            return str(exc)
        return None

    def state(self) -> str:
        return _files_digest(self._paths())

    parallel = True

    def max_tasks(self, requested: int) -> int:
        return max(1, min(requested, len(self._paths())))  # a file is read by one task

    def task_records(self, rank: int, world: int) -> Iterator[Document | Rejected]:
        paths = self._paths()  # a contiguous block of the files, so the tasks' parts are in read order
        yield from self._read(paths[rank * len(paths) // world : (rank + 1) * len(paths) // world])

    def records(self) -> Iterator[Document | Rejected]:
        yield from self._read(self._paths())

    def _read(self, paths: list[Path]) -> Iterator[Document | Rejected]:
        for path in paths:
            if path.suffix == ".parquet":
                yield from self._parquet(path)
            else:
                yield from self._jsonl(path)

    def _jsonl(self, path: Path) -> Iterator[Document | Rejected]:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                where = f"{path.name}:{lineno}"
                if not raw.strip():  # counted like every line that holds no document
                    yield Rejected("blank_line", where)
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield Rejected("invalid_utf8", where)
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    yield Rejected("malformed_json", where)
                    continue
                yield _extract(record, self.config, where)

    def _parquet(self, path: Path) -> Iterator[Document | Rejected]:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        names = tuple(table.schema_arrow.names)
        if self.config.text_field not in names:  # every row lacks it: count them, read none
            yield Rejected(
                "missing_text_field",
                f"{path.name}: all {table.metadata.num_rows} rows",
                names,
                count=table.metadata.num_rows,
            )
            return
        row = 0
        for batch in table.iter_batches():
            for record in batch.to_pylist():
                row += 1
                yield _extract(record, self.config, f"{path.name}:{row}")


@SOURCE_KINDS.register("hf:")
class HuggingFace(SourceKind):
    """A `datasets` dataset: a `save_to_disk` folder, or a hub dataset (streamed)."""

    def _target(self) -> str:
        return self.config.uri.split(":", 1)[1]

    def state(self) -> str:
        target = from_base(self._target())
        if target.is_dir():
            return _files_digest(sorted(p for p in target.rglob("*") if p.is_file()))
        c = self.config
        return f"{self._target()}|{c.hf_subset}|{c.hf_split}|{c.hf_revision}"

    def _is_local(self) -> bool:
        target = self._target()
        return target.startswith(("/", ".", "~")) or from_base(target).exists()

    def check(self) -> list[str]:
        if not self._is_local():
            return []  # a hub dataset: checking it needs the network (the step reports it)
        target = from_base(self._target())
        if not target.is_dir():
            return [
                f"{self.where}.uri: {target} is not a folder; hf:/PATH takes a folder written by datasets' save_to_disk"
            ]
        info = target / "dataset_info.json"
        splits = target / "dataset_dict.json"
        if splits.is_file():
            names = json.loads(splits.read_text(encoding="utf-8")).get("splits", [])
            if self.config.hf_split not in names:
                return [
                    f"{self.where}.hf_split: {self.config.hf_split!r} is not a split of {target} "
                    f"(splits: {', '.join(names)})"
                ]
            info = target / self.config.hf_split / "dataset_info.json"
        if not info.is_file():
            return [f"{self.where}.uri: {target} holds no dataset_info.json; is it a save_to_disk folder?"]
        features = json.loads(info.read_text(encoding="utf-8")).get("features") or {}
        fields = set(features)
        errors = []
        for key in ("text_field", "id_field"):
            field = getattr(self.config, key)
            if field is not None and field not in fields:
                errors.append(
                    f"{self.where}.{key}: {field!r} is not a column of {target} (columns: {', '.join(sorted(fields))})"
                )
        text = features.get(self.config.text_field)
        if isinstance(text, dict) and text.get("dtype") not in ("string", "large_string"):
            errors.append(_not_text(self.where, self.config.text_field, target))
        return errors

    def is_readable(self) -> bool:
        return self._is_local() and self.missing() is None

    def missing(self) -> str | None:
        if not self._is_local():
            return None
        target = from_base(self._target())
        return None if target.exists() else f"{self.where}.uri: {target} does not exist on this machine"

    parallel = True

    def max_tasks(self, requested: int) -> int:
        return max(1, requested)

    def records(self) -> Iterator[Document | Rejected]:
        return self.task_records(0, 1)

    def task_records(self, rank: int, world: int) -> Iterator[Document | Rejected]:
        import datasets

        target = from_base(self._target())
        if target.is_dir():
            ds = datasets.load_from_disk(str(target))
            if isinstance(ds, datasets.DatasetDict):
                if self.config.hf_split not in ds:
                    raise KeyError(
                        f"source {self.config.name!r}: split {self.config.hf_split!r} not in "
                        f"{target}; available: {', '.join(ds)}"
                    )
                ds = ds[self.config.hf_split]
            # a contiguous block of rows (Arrow files, memory-mapped: nothing loaded whole), so
            # a row's id `row N` is the same whatever the task count
            first = rank * len(ds) // world
            rows: Any = ds.select(range(first, (rank + 1) * len(ds) // world))
            where = "row {}"
        else:
            # The hub path: needs network access (HF_HUB_OFFLINE unset) and, for gated sets, a
            # token in the standard Hugging Face location. Streamed, never downloaded whole; with
            # several tasks each streams its part (`split_dataset_by_node`: whole files when the
            # dataset has a multiple of `world` files, else every world-th row), and a row
            # without `id_field` is named by its task and its row within it.
            from datasets.distributed import split_dataset_by_node

            stream = datasets.load_dataset(
                self._target(),
                self.config.hf_subset,
                split=self.config.hf_split,
                revision=self.config.hf_revision,
                streaming=True,
            )
            rows = stream if world == 1 else split_dataset_by_node(stream, rank=rank, world_size=world)
            first, where = 0, "row {}" if world == 1 else f"task {rank}/{world} row {{}}"
        for i, record in enumerate(rows, first):
            yield _extract(record, self.config, where.format(i))


def held_out_rank(source: str, doc_id: str) -> int:
    """A document's stable 64-bit hash: the held-out split takes a share of them by value
    (`is_held_out`), and a capped split the smallest ones of that share (tasks/sources.py)."""
    return int.from_bytes(hashlib.sha1(f"{source}\0{doc_id}".encode()).digest()[:8], "big")


def is_held_out(source: str, doc_id: str, fraction: float) -> bool:
    """Stable membership of a document in the held-out split (same answer on every machine)."""
    return held_out_rank(source, doc_id) % 1_000_000 < round(fraction * 1_000_000)


class ShardWriter:
    """Writes documents into numbered shards of one split, gzip JSONL or Parquet.

    Documents are dealt round robin to `streams` open shards (document i to stream i % streams),
    and a stream that reaches `per_shard` documents is written out and starts a new shard: a
    split of n documents becomes max(streams, n / per_shard) shards of near-equal size, so a
    small source still splits into `streams` datatrove tasks. Shards are numbered in the order
    they are written, which depends only on the documents' order.
    """

    def __init__(
        self, folder: Path, fmt: str, per_shard: int, streams: int = 1, *, prefix: str = "", layout: Any = None
    ):
        self.folder, self.fmt, self.per_shard = folder, fmt, per_shard
        folder.mkdir(parents=True, exist_ok=True)
        self.buffers: list[list[dict[str, Any]]] = [[] for _ in range(streams)]
        self.positions: list[list[int]] = [[] for _ in range(streams)]
        self.added = 0
        self.shards: list[str] = []
        # several writers share a folder by their prefixes (an ingestion task's `00003-`); with
        # `layout` (a text file), each shard written adds a line `name<TAB>position,...` naming
        # the `add` positions it holds, so a later pass can rewrite the shards that hold some
        self.prefix, self.layout = prefix, layout

    def add(self, doc: Document, source: str, position: int = 0) -> None:
        stream = self.added % len(self.buffers)
        self.added += 1
        buffer = self.buffers[stream]
        buffer.append({"id": doc.id, "text": doc.text, "metadata": {**doc.metadata, "source": source}})
        self.positions[stream].append(position)
        if len(buffer) >= self.per_shard:
            self._write(stream)

    def flush(self) -> None:
        for stream in range(len(self.buffers)):
            self._write(stream)

    def _write(self, stream: int) -> None:
        rows = self.buffers[stream]
        if not rows:
            return
        name = f"{self.prefix}{len(self.shards):05d}.{'parquet' if self.fmt == 'parquet' else 'jsonl.gz'}"
        write_shard(self.folder / name, rows)
        if self.layout is not None:
            self.layout.write(f"{name}\t{','.join(map(str, self.positions[stream]))}\n")
        self.shards.append(name)
        self.buffers[stream], self.positions[stream] = [], []


def write_shard(path: Path, rows: list[dict[str, Any]]) -> None:
    """One shard of rows (`id`, `text`, `metadata`): gzip JSONL, or Parquet (by the name)."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = [{**r, "metadata": json.dumps(r["metadata"])} for r in rows]
        pq.write_table(pa.Table.from_pylist(table), path)
    else:
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=5) as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_shard(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of one shard written by `write_shard`, in order."""
    if path.name.endswith(".jsonl.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for row in pq.read_table(path).to_pylist():
            yield {**row, "metadata": json.loads(row["metadata"])}


def read_shards(folder: Path) -> Iterator[dict[str, Any]]:
    """Documents of one split folder written by ShardWriter, in order."""
    for path in sorted(Path(folder).iterdir()):
        yield from read_shard(path)


def source_state(config: SourceConfig, seed: int | None) -> str:
    return resolve_kind(config.uri)(config, seed or 0).state()


def missing_sources(sources: Sequence[SourceConfig]) -> dict[str, str]:
    """Source name -> why its data is not on this machine, for the sources whose data is not."""
    found = {c.name: resolve_kind(c.uri)(c, 0).missing() for c in sources}
    return {name: why for name, why in found.items() if why}


def check_sources(sources: Sequence[SourceConfig]) -> list[str]:
    """Every configuration mistake of the recipe's sources that would fail the run, cheaply:
    a glob matching nothing, files that are neither JSONL nor Parquet, a text or id field the
    files lack (read from the Parquet schema or the first records), a save_to_disk folder
    without the split or column. Hub datasets are not checked. An empty list: nothing found."""
    errors: list[str] = []
    for config in sources:
        errors += resolve_kind(config.uri)(config, 0).check()
    return errors
