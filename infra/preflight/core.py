"""Preflight core: results, the check base class and registry, the config and the recipe facts,
the stop error (`PreflightFailed`) and the rows of the lineage `preflight` table.

A preflight check measures one thing about the machine, the storage, the data or the recipe before
a long training run spends GPU-weeks on it, and answers with a `CheckResult`: pass, warn, fail or
skip, the measured value with its unit, the threshold it was held to, and advice. Checks are small
classes registered in `CHECKS` (a `Registry`, so a duplicate name is refused) and run in `order`.

`PreflightConfig` holds what the operator chooses (thresholds, which checks, where checkpoints go);
`PreflightFacts` holds what the recipe implies (world size, batch, sequence, vocab, tokens per
stage, ...). The caller fills the facts; checks never read the recipe or the environment at import.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.registry import Registry

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class CheckResult:
    """The answer of one check; `value` and `threshold` are human strings carrying their units."""

    name: str
    status: Status
    value: str = ""  # what was measured, with its unit ("712.4 TFLOP/s min of 8 GPUs")
    threshold: str = ""  # what it was held to (">= 90% of best 731.0 TFLOP/s")
    advice: str = ""  # what to do about a warn or fail, or why a check was skipped
    metric: float | None = None  # the headline number, for the planner and for trends in lineage
    seconds: float = 0.0  # how long the check took

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


STAGE_LAYOUT_KEYS = ("nodes", "tp", "cp", "micro_batch", "global_batch")  # what a stage may set apart


@dataclass(frozen=True)
class PreflightFacts:
    """What the recipe implies for the machine; the caller fills it from the resolved recipe."""

    device: Literal["cuda", "cpu"] = "cpu"  # where the recipe trains; cuda makes GPU checks binding
    nodes: int = 1  # nodes of the training job
    nproc_per_node: int = 1  # ranks per node (GPUs per node on a GPU cluster)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    cp: int = 1  # context-parallel degree: ranks each sequence is split over (they share one batch)
    global_batch: int = 0  # sequences per optimizer step across all ranks (0: not known)
    micro_batch: int = 0  # sequences per rank per forward/backward (0: not known)
    seq_len: int = 0  # training sequence length in tokens
    max_positions: int = 0  # the model's max_position_embeddings
    tokenizer_vocab: int = 0  # tokens the tokenizer can emit (incl. special tokens)
    model_vocab: int = 0  # rows of the model's embedding matrix
    params: int = 0  # model parameters (for checkpoint-size estimates)
    stage_tokens: Mapping[str, int] = field(default_factory=dict)  # stage -> tokens trained on
    stage_seq_len: Mapping[str, int] = field(default_factory=dict)  # stage -> its seq_len (else seq_len)
    # stage -> the layout keys it sets apart (nodes, tp, cp, micro_batch, global_batch); the rest
    # are the fields above (the 3B recipe's long-context stages: 12 nodes, TP 2 x CP 4, micro 1)
    stage_layouts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    available_tokens: Mapping[str, int] = field(default_factory=dict)  # stage -> unique tokens
    # stage -> the repeats its recipe accepts (`stages[].max_epochs`, set explicitly): data_epochs
    # fails that stage only above the larger of this and the check's `max_epochs`
    stage_max_epochs: Mapping[str, float] = field(default_factory=dict)
    shards: tuple[str, ...] = ()  # tokenized shard folders (.ds files) that must exist
    mixture_plans: tuple[str, ...] = ()  # plan.json of each stage's mixture step (per-source epochs)
    checkpoint_keep: int = 0  # checkpoints retained on disk at once
    checkpoint_bytes: int = 0  # approximate size of one checkpoint (0: estimate from params)
    eval_tasks: tuple[str, ...] = ()  # lm-eval task names run on every checkpoint
    workspace: str = "workspace"  # the workspace folder of the run
    open_files: int = 0  # open files a rank needs (model/host_memory.py; 0: not known)
    host_memory_gb: float = 0  # host memory a node needs, GB (model/host_memory.py; 0: not known)

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"preflight facts: device must be cuda or cpu, got {self.device!r}")
        for name in ("nodes", "nproc_per_node", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"preflight facts: {name} must be >= 1, got {getattr(self, name)}")
        for stage, layout in dict(self.stage_layouts).items():
            unknown = sorted(set(layout) - set(STAGE_LAYOUT_KEYS))
            if unknown:
                raise ValueError(
                    f"preflight facts: stage_layouts[{stage}] has unknown key(s) {', '.join(unknown)}; "
                    f"allowed: {', '.join(STAGE_LAYOUT_KEYS)}"
                )
            bad = {k: v for k, v in layout.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
            if bad:
                raise ValueError(f"preflight facts: stage_layouts[{stage}] values must be integers >= 1, got {bad}")
        for name in (
            "global_batch",
            "micro_batch",
            "seq_len",
            "max_positions",
            "tokenizer_vocab",
            "model_vocab",
            "params",
            "checkpoint_keep",
            "checkpoint_bytes",
            "open_files",
            "host_memory_gb",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"preflight facts: {name} must be >= 0 (0: not known), got {getattr(self, name)}")
        for name in ("stage_tokens", "available_tokens"):
            negative = {k: v for k, v in dict(getattr(self, name)).items() if v < 0}
            if negative:
                raise ValueError(f"preflight facts: {name} must be >= 0, got {negative}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def layouts(self) -> dict[str, dict[str, int]]:
        """Each distinct training layout: "" for the fields above, then every stage that sets
        its own (its keys over the fields above), as {nodes, tp, cp, micro_batch, global_batch}."""
        base = {k: getattr(self, k) for k in STAGE_LAYOUT_KEYS}
        found = {"": base}
        for stage, own in dict(self.stage_layouts).items():
            layout = {**base, **own}
            if layout != base:
                found[stage] = layout
        return found

    @property
    def checkpoint_size(self) -> int:
        """Bytes of one checkpoint: the recipe's figure, else fp32 weights + two Adam moments."""
        return self.checkpoint_bytes or 12 * self.params

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (for step params and fingerprints)."""
        d = dataclasses.asdict(self)
        d["stage_tokens"] = dict(self.stage_tokens)
        d["stage_seq_len"] = dict(self.stage_seq_len)
        d["stage_layouts"] = {k: dict(v) for k, v in self.stage_layouts.items()}
        d["available_tokens"] = dict(self.available_tokens)
        d["stage_max_epochs"] = dict(self.stage_max_epochs)
        d["shards"] = list(self.shards)
        d["mixture_plans"] = list(self.mixture_plans)
        d["eval_tasks"] = list(self.eval_tasks)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreflightFacts:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"preflight facts: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        d = dict(data)
        for name in ("shards", "mixture_plans", "eval_tasks"):
            if name in d:
                d[name] = tuple(d[name])
        for name in ("stage_tokens", "available_tokens"):
            if name in d:
                d[name] = {str(k): int(v) for k, v in dict(d[name]).items()}
        if "stage_max_epochs" in d:
            d["stage_max_epochs"] = {str(k): float(v) for k, v in dict(d["stage_max_epochs"]).items()}
        return cls(**d)


class PreflightConfig(BaseModel):
    """What the operator chooses: which checks run and the thresholds they are held to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- selection --------------------------------------------------------------------------
    checks: tuple[str, ...] | None = None  # run only these checks (None: every registered one)
    skip: tuple[str, ...] = ()  # checks not to run (reported as skip, so the gap is visible)
    allow_warn: bool = False  # proceed to training despite warnings (never despite a fail)
    # --- GPUs -------------------------------------------------------------------------------
    expected_gpus: int | None = Field(default=None, ge=0)  # GPUs per node (None: nproc_per_node)
    matmul_size: int = Field(default=8192, ge=64)  # n of the n x n bf16 matmul stress
    matmul_seconds: float = Field(default=3.0, gt=0)  # sustained stress time per GPU
    gpu_slow_fraction: float = Field(default=0.10, gt=0, lt=1)  # fail a GPU this far below best
    min_gpu_tflops: float = Field(default=0.0, ge=0)  # absolute floor (H100 dense bf16 ~730)
    max_gpu_temp_c: float = Field(default=87.0, gt=0)  # hotter under load than this fails
    min_clock_fraction: float = Field(default=0.75, gt=0, le=1)  # SM clock / max under load: warn
    gpu_memory_gib: float = Field(default=8.0, gt=0)  # allocation of the memory pattern test
    ecc_corrected_warn: int = Field(default=1, ge=1)  # corrected ECC errors that warn
    dcgm_level: Literal[0, 1, 2, 3] = 1  # dcgmi diag -r level (0: do not run DCGM)
    nccl_mib: float = Field(default=256.0, gt=0)  # all-reduce message size for NCCL
    min_nccl_busbw_gbps: float = Field(default=100.0, ge=0)  # intra-node NVLink floor (H100 ~400)
    # --- CPU --------------------------------------------------------------------------------
    cpu_matmul_size: int = Field(default=1024, ge=16)  # n of the fp32 CPU matmul
    cpu_matmul_seconds: float = Field(default=1.0, gt=0)  # time spent on it
    gloo_ranks: int = Field(default=2, ge=2)  # local ranks of the gloo all-reduce
    gloo_mib: float = Field(default=4.0, gt=0)  # all-reduce message size for gloo
    min_gloo_busbw_gbps: float = Field(default=0.0, ge=0)  # 0: informational only
    collective_iters: int = Field(default=10, ge=1)  # timed all-reduces after warmup
    collective_timeout_s: float = Field(default=300.0, gt=0)  # kill a hung torchrun after this
    # --- storage ----------------------------------------------------------------------------
    checkpoint_dir: str | None = None  # where checkpoints go, relative to the workspace (None: checkpoints)
    disk_headroom: float = Field(default=1.2, ge=1.0)  # free space needed / retained checkpoints
    io_probe_mib: int = Field(default=64, ge=1)  # size of the write/read throughput probe
    min_write_mbps: float = Field(default=100.0, ge=0)  # slower checkpoint writes warn
    min_read_mbps: float = Field(default=100.0, ge=0)  # slower checkpoint reads warn
    s3_uri: str | None = None  # s3://bucket/prefix for checkpoint upload (None: no S3 check)
    s3_endpoint_url: str | None = None  # non-AWS endpoint (MinIO, moto); None: AWS default
    s3_probe_mib: int = Field(default=4, ge=1)  # object size of the S3 round trip
    # --- data and evals ---------------------------------------------------------------------
    max_epochs: float = Field(default=4.0, ge=1.0)  # more repeats than this fail (1 to this: warn)
    eval_tasks_dir: str | None = None  # local lm-eval task folder (YAML files with `task:`)
    eval_lm_eval_lookup: bool = True  # resolve other names through lm-eval's TaskManager (~10 s)

    @model_validator(mode="after")
    def _known_checks(self) -> PreflightConfig:
        named = list(self.checks or ()) + list(self.skip)
        unknown = sorted({n for n in named if n not in CHECKS})
        if unknown:
            raise ValueError(f"unknown preflight check(s) {', '.join(unknown)}; known: {', '.join(CHECKS.names())}")
        if self.s3_uri is not None and not self.s3_uri.startswith("s3://"):
            raise ValueError(f"s3_uri {self.s3_uri!r} must look like s3://bucket/prefix")
        return self

    def checkpoint_path(self, facts: PreflightFacts) -> Path:
        """Where checkpoints go: `checkpoint_dir` (a relative one is inside the workspace), else
        `{workspace}/checkpoints`."""
        folder = Path(self.checkpoint_dir or "checkpoints").expanduser()
        return folder if folder.is_absolute() else Path(facts.workspace).expanduser() / folder


@dataclass
class CheckContext:
    """What a check may use: its inputs, the injected device and command layers, a memo."""

    config: PreflightConfig
    facts: PreflightFacts
    gpu: Any  # a GpuBackend (infra.preflight.gpu); injected so tests use a fake
    commands: Any  # a CommandRunner (infra.preflight.commands); injected likewise
    log: Callable[[str], None] = print
    memo: dict[str, Any] = field(default_factory=dict)  # results checks share (stress -> throttle)


class Check(ABC):
    """Base class of a preflight check: set `name`, `group`, `order`; implement `run`."""

    name: ClassVar[str]
    group: ClassVar[str]  # gpu | compute | host | storage | data | config
    order: ClassVar[int]  # run order; cheap config checks first, GPU stress before its readers

    @abstractmethod
    def run(self, ctx: CheckContext) -> CheckResult:
        """Measure and judge; return one CheckResult."""

    # Helpers so checks read as one line per outcome.
    def result(
        self, status: Status, value: str = "", threshold: str = "", advice: str = "", metric: float | None = None
    ) -> CheckResult:
        return CheckResult(self.name, status, value, threshold, advice, metric)

    def skip(self, why: str) -> CheckResult:
        return CheckResult(self.name, "skip", advice=why)


CHECKS: Registry[type[Check]] = Registry("preflight check")


def register(cls: type[Check]) -> type[Check]:
    """Class decorator: register a check under its `name` (a duplicate name is refused)."""
    return CHECKS.register(cls.name)(cls)


def selected(config: PreflightConfig) -> list[type[Check]]:
    names = config.checks if config.checks is not None else CHECKS.names()
    return sorted((CHECKS.get(n) for n in names), key=lambda c: (c.order, c.name))


def should_stop(results: list[CheckResult], allow_warn: bool = False) -> bool:
    """Stop on any fail; a warn stops too unless the operator explicitly allowed warnings."""
    statuses = {r.status for r in results}
    return "fail" in statuses or ("warn" in statuses and not allow_warn)


def blocking(results: list[CheckResult], allow_warn: bool = False) -> list[CheckResult]:
    """The results that make `should_stop` true (fails, and warns unless allowed)."""
    bad = {"fail"} if allow_warn else {"fail", "warn"}
    return [r for r in results if r.status in bad]


def summary(results: list[CheckResult]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for r in results:
        counts[r.status] += 1
    return counts


def format_table(results: list[CheckResult]) -> str:
    """A fixed-width table for terminals: check, status, value, threshold, advice."""
    head = ("check", "status", "value", "threshold", "advice")
    rows = [(r.name, r.status.upper(), r.value, r.threshold, r.advice) for r in results]
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:4], widths, strict=True)) + "  " + head[4]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[4]))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
    counts = summary(results)
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(line.rstrip() for line in lines)


def format_markdown(results: list[CheckResult]) -> str:
    """The same table as Markdown (step folder, Prefect UI)."""

    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| check | status | value | threshold | advice |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {esc(r.name)} | {r.status} | {esc(r.value)} | {esc(r.threshold)} | {esc(r.advice)} |")
    counts = summary(results)
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items())]
    return "\n".join(lines)


def metric_of(results: list[CheckResult], name: str) -> float | None:
    """The metric of check `name` in `results`; None when it did not run or was skipped."""
    return next((r.metric for r in results if r.name == name and r.status != "skip"), None)


def lineage_rows(run_id: str, results: list[CheckResult], created: Any = None) -> list[tuple]:
    """Rows of the lineage `preflight` table: run_id, check_name, status, value, threshold, advice,
    created."""
    from datetime import UTC, datetime

    created = created or datetime.now(UTC).replace(tzinfo=None)
    return [(run_id, r.name, r.status, r.value, r.threshold, r.advice, created) for r in results]


class PreflightFailed(RuntimeError):
    """Preflight found blocking problems; `results` holds every check's result."""

    def __init__(self, message: str, results: list[CheckResult]):
        super().__init__(message)
        self.results = results
