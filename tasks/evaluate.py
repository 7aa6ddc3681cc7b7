"""Evaluation: cloze tasks from the held-out splits, passkey retrieval, contamination, lm-eval.

The steps and their config; the suite's tasks are evals/benchmarks/ (one module each, registered
in evals/suite.py `TASKS`, which builds them), running lm-eval and reading its results
evals/harness.py.

Two steps:
- `eval_suite` builds the task files once per data version: cloze-format multiple-choice tasks
  from each domain's held-out split (prose continuation, code continuation, arithmetic), passkey
  retrieval at several context lengths, and a contamination report (word n-gram overlap between
  every eval item and the training corpora). Tasks are lm-eval YAML files (`dataset_path: json`
  with local `data_files`), so they run offline and anyone can rerun them with `lm_eval`.
- `evaluate` runs lm-eval on one exported checkpoint over the suite (plus any hub task names from
  the recipe, for users with hub access) and records the scores and lm-eval's full results. The
  model is lm-eval's `hf` model with each shared context scored once (evals/lm.py; the
  same scores, ~3x less forward work on the cloze and passkey tasks).

Cloze formulation (the playbook's choice for early checkpoints): the model scores each choice's
log-likelihood after the context; `acc_norm` normalises by the choice's length, so it does not
favour short continuations. Random accuracy is 1 / choices, recorded for margin checks.

Each task has one headline metric (`headline_metric`: acc_norm for the prose and code cloze tasks
and hub tasks that report it, acc for arithmetic numbers and passkeys, exact_match for
generation), shown with its stderr, the items scored and the task's random baseline (the mean of
1 / choices over its items; for exact match the constant guess: the share of the items whose
answer is the most common one), so a score on 20 items reads as what it is.
`evaluate` logs items done per task and an ETA while lm-eval runs (evals/lm.py `EvalProgress`)
and reports the same as a progress artifact.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from curation.bpe import render_chat
from curation.source_kinds import read_shards
from evals.harness import (
    headline_metric,
    items_scored,
    random_baselines,
    run_lm_eval,
    scores_markdown,
    stage_tasks,
    suite_task_files,
)
from evals.suite import build_suite
from model.config import RopeScaling
from pipeline.artifact import Artifact, added_identity, operational
from pipeline.step import step
from trainers.posttrain.sections import ReasoningModesConfig


class EvalConfig(BaseModel):
    """The recipe's `eval` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    items_per_task: int = Field(default=200, gt=0)  # cloze items per task (fewer if data is short)
    choices: int = Field(default=4, ge=2, le=26)  # choices per item: 1 gold + distractors (a letter each)
    context_words: int = Field(default=48, gt=0)  # prose context length
    continuation_words: int = Field(default=12, gt=0)  # prose continuation length
    code_context_lines: int = Field(default=10, gt=0)  # code context length in lines
    # passkey contexts, in words of filler (at most 2**18: SmolLM3's 128k tokens are ~100k words)
    passkey_lengths: tuple[Annotated[int, Field(gt=0, le=2**18)], ...] = (128, 384, 896)
    passkey_items: int = Field(default=20, gt=0)  # items per passkey length
    lm_eval_tasks: tuple[str, ...] = ()  # extra lm-eval task names (hub data: needs network)
    contamination_ngram: int = Field(default=8, ge=4)  # word n-gram length for overlap
    contamination_max_docs: int = Field(default=50_000, gt=0)  # training docs scanned per corpus
    batch_size: int = operational(8, gt=0)  # lm-eval batch size (generation; the stock hf path)
    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]{1,2})?)$"
    )  # "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    limit: int | None = Field(default=None, gt=0)  # cap items per task (quick checks)
    # After a context-extension stage: also the short cloze tasks (a regression check), or only
    # passkey retrieval (the tiny recipe: its long stages train a few steps, and the final long
    # model is scored on the cloze tasks by post-training's `evaluate[base]` anyway)
    long_context_cloze: bool = True
    # The last stage read past its trained length (docs/model.md "Long context: YaRN"): at this
    # many times its seq_len, with plain RoPE and with YaRN (SmolLM3: 2, 64k -> 128k); None = not
    beyond_factor: float | None = added_identity(None, ge=1.0)
    # passkey filler of those evaluations, in words: more than the trained length, at most the factor x
    beyond_passkey_words: int | None = added_identity(None, gt=0, le=2**18)

    @model_validator(mode="after")
    def _beyond_has_its_passkeys(self) -> EvalConfig:
        if self.beyond_factor is not None and self.beyond_passkey_words is None:
            raise ValueError(
                f"eval.beyond_factor={self.beyond_factor} needs eval.beyond_passkey_words (the passkey length, "
                "in words, those evaluations score)"
            )
        return self

    def for_suite(self) -> EvalConfig:
        """This section as the eval_suite step sees it: the fields that only say how models are
        evaluated are at their defaults, so changing them does not rebuild the suite."""
        return self.model_copy(
            update={
                f: type(self).model_fields[f].default for f in (*_RUN_FIELDS, "long_context_cloze", "beyond_factor")
            }
        )

    def for_run(self) -> EvalConfig:
        """This section as the evaluate step sees it: only the fields that say how models are
        evaluated; the suite's fields are at their defaults (the suite input carries them)."""
        keep = set(_RUN_FIELDS)  # long_context_cloze and beyond_factor reach the step as EvalSpec's
        return self.model_copy(
            update={f: type(self).model_fields[f].default for f in type(self).model_fields if f not in keep}
        )


# EvalConfig fields the evaluate step uses and the eval_suite step does not.
_RUN_FIELDS = ("lm_eval_tasks", "batch_size", "device", "limit")


def _texts(folder: Path, limit: int | None = None) -> Iterator[str]:
    for i, doc in enumerate(read_shards(folder)):
        if limit is not None and i >= limit:
            return
        yield doc["text"]


def publish_eval(artifact: Artifact, ws, label: str) -> None:
    """Scores to DuckDB (`evals`) and a Prefect table artifact: per task its headline metric,
    ± stderr, items and random baseline."""
    from datetime import UTC, datetime

    from prefect.artifacts import create_table_artifact
    from prefect.runtime import flow_run

    now = datetime.now(UTC).replace(tzinfo=None)
    run_id = str(flow_run.id) if flow_run.id else None
    rows, table = [], []
    items, random = artifact.meta.get("items", {}), artifact.meta.get("random_baseline", {})
    for task, metrics in sorted(artifact.meta["scores"].items()):
        for metric, value in metrics.items():
            if metric.endswith("_stderr"):
                continue
            rows.append((artifact.fingerprint, run_id, task, metric, value, metrics.get(f"{metric}_stderr"), now))
        metric = headline_metric(task, metrics)
        if metric is not None:
            se, base = metrics.get(f"{metric}_stderr"), random.get(task)
            table.append(
                {
                    "model": label,
                    "task": task,
                    "metric": metric,
                    "score": round(metrics[metric], 4),
                    "stderr": None if se is None else round(se, 4),
                    "items": items.get(task),
                    "random": None if base is None else round(base, 4),
                }
            )
    ws.lineage().record_rows("evals", rows)
    key = re.sub(r"[^a-z0-9-]+", "-", f"eval-{label}".lower())
    create_table_artifact(table=table, key=key, description=f"lm-eval scores after {label}")
    _scores_to_trackers(artifact, ws)


def _scores_to_trackers(artifact: Artifact, ws) -> None:
    """The scores of a pretraining stage's checkpoint, into that stage's tracker run at its last
    step (trainers/tracker.py): the eval curve sits beside the loss. The stage is found through
    lineage: this evaluation <- its export <- the pretrain artifact."""
    from prefect import get_run_logger

    from trainers.tracker import TrackerUnavailable, log_scores

    lineage = ws.lineage()
    stages = [
        stage
        for model in lineage.inputs_of(artifact.fingerprint, kind="hf_model")
        for stage in lineage.inputs_of(model.fingerprint, kind="checkpoint")
        if stage.meta.get("steps") and not stage.uri.startswith("s3://")
    ]
    for stage in stages:
        try:
            folder = log_scores(stage.path, int(stage.meta["steps"]), artifact.meta["scores"])
        except (TrackerUnavailable, OSError, KeyError, ValueError) as exc:  # the scores are in lineage anyway
            get_run_logger().warning(f"eval scores not sent to the stage's tracker: {exc}")
            continue
        if folder is not None:
            get_run_logger().info(f"eval scores added to the tracker run {folder}")


class SuiteSpec(BaseModel):
    """The eval_suite step's config: the recipe's eval section (as `EvalConfig.for_suite`), the
    seed of item sampling, and for post-training suites the exact-match generation task, whose
    prompts carry the recipe's `reasoning_modes` system turns (those the model was trained on)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eval: EvalConfig
    seed: int = 0
    generation_items: int = Field(default=0, ge=0)  # arithmetic exact-match items (0: none)
    max_gen_tokens: int = Field(default=48, gt=0)  # tokens generated per answer
    # > 0: the think-mode twin of the generation task too, this many tokens per answer
    think_gen_tokens: int = added_identity(0, ge=0)
    # the system turn of each reasoning mode in the generation prompts (the recipe's reasoning_modes)
    modes: ReasoningModesConfig = added_identity(ReasoningModesConfig())

    def chat_prompt(self, question: str, think: bool) -> str:
        """`question` as a chat model is asked it in a reasoning mode: the mode's system turn of
        `modes` and the user turn, rendered by the tokenizer's chat template with the generation
        prompt (curation/bpe.py), the prefix of a training row of that mode for that question."""
        system = self.modes.think_system if think else self.modes.no_think_system
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return render_chat(messages, add_generation_prompt=True)


class BeyondSpec(BaseModel):
    """A model read past the length it was trained at: lm-eval's window is `factor` x
    `trained_len` tokens, the RoPE plain or YaRN (model/config.py `RopeScaling`, factor over
    the trained length: how SmolLM3 is served at 128k)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trained_len: int = Field(gt=0)  # the last stage's seq_len
    factor: float = Field(ge=1.0)  # read at factor x trained_len
    yarn: bool  # YaRN over the trained length (else plain RoPE, extrapolated)

    @property
    def max_length(self) -> int:
        return int(self.factor * self.trained_len)

    def rope_scaling(self) -> RopeScaling | None:
        return RopeScaling(self.factor, self.trained_len) if self.yarn else None


class EvalSpec(BaseModel):
    """The evaluate step's config: how to score a model, and whether it is long-context (passkey
    retrieval runs only then). The tasks come from the suite input, not from the flow."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eval: EvalConfig
    long_context: bool = False  # a context-extension stage: passkey retrieval runs too
    cloze: bool = True  # the suite's short tasks run too (`eval.long_context_cloze` after extension)
    beyond: BeyondSpec | None = added_identity(None)  # read past the trained length: its passkeys only

    @classmethod
    def of(cls, eval: EvalConfig, long_context: bool = False) -> EvalSpec:
        return cls(eval=eval.for_run(), long_context=long_context, cloze=not long_context or eval.long_context_cloze)

    @classmethod
    def past_training(cls, eval: EvalConfig, trained_len: int, yarn: bool) -> EvalSpec:
        """The evaluation of the last stage at `eval.beyond_factor` x its `trained_len`."""
        if eval.beyond_factor is None:
            raise ValueError("eval.beyond_factor is not set: no evaluation past the trained length")
        beyond = BeyondSpec(trained_len=trained_len, factor=eval.beyond_factor, yarn=yarn)
        run = eval.for_run().model_copy(update={"lm_eval_tasks": ()})  # its passkeys only
        return cls(eval=run, long_context=True, cloze=False, beyond=beyond)


@step("eval_suite", version=4, kind="eval", resource="data", isolate=True, retries=1)
def eval_suite(
    config: SuiteSpec, heldout: tuple[Artifact, ...], train: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """The eval suite from the held-out splits of the `heldout` corpora: every registered task's
    JSONL + YAML in `out/tasks` (evals/suite.py `TASKS`), and the contamination report against the
    training text of the `train` corpora; with `generation_items`, also the exact-match generation
    task (for post-trained chat models)."""
    by_domain: dict[str, list[str]] = {"web": [], "code": [], "math": []}
    for art in heldout:
        by_domain[art.meta["domain"]].extend(_texts(art.path / "heldout"))
    limit = config.eval.contamination_max_docs
    training = (t for art in train for t in _texts(art.path / "train", limit))
    return build_suite(config, by_domain, training, out, log)


@step("evaluate", version=3, kind="eval", publish=publish_eval, resource="eval")
def evaluate(
    config: EvalSpec, model: Artifact, suite: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """lm-eval over one exported `model` on the tasks of the `suite` it should run
    (`stage_tasks`): scores, items and random baselines per task."""
    from evals.lm import EvalProgress

    cfg = config.eval
    tasks = stage_tasks(cfg, suite, config.long_context, config.cloze, beyond=config.beyond is not None)
    if config.beyond is not None and not tasks:
        raise ValueError(f"the suite {suite.short} has no passkey_beyond task: set eval.beyond_passkey_words")
    available = set(suite.meta["tasks"])
    missing = [t for t in tasks if t not in available and t not in cfg.lm_eval_tasks]
    if missing:
        raise ValueError(
            f"eval tasks {missing} are not in the suite ({', '.join(sorted(available))}) nor in "
            "the recipe's eval.lm_eval_tasks"
        )
    expected = {t: min(suite.meta["tasks"][t], cfg.limit or 1 << 60) for t in tasks if t in available}
    listing = ", ".join(f"{t} ({expected[t]} items)" if t in expected else t for t in tasks)
    log(f"evaluating {model.meta.get('stage', model.short)} ({model.meta['model_dir']}) on {listing}")
    reading: dict[str, Any] = {}
    if config.beyond is not None:
        b = config.beyond
        reading = {"max_length": b.max_length, "rope_scaling": b.rope_scaling()}
        how = f"YaRN {reading['rope_scaling']}" if b.yarn else "plain RoPE"
        log(f"read at {b.max_length} tokens ({b.factor:g} x the trained {b.trained_len}) with {how}")
    meter = EvalProgress(log, progress, expected)
    # lm-eval runs only task files the suite's builders regenerate here, in a private folder
    # (evals/harness.py suite_task_files); a changed suite YAML is refused, a planted file ignored.
    private = Path(tempfile.mkdtemp(prefix="smollm3-suite-tasks-"))
    try:
        local = [t for t in tasks if t in available]
        task_dir = suite_task_files(Path(suite.meta["task_dir"]), local, available, private, log) if local else None
        scores = run_lm_eval(Path(model.meta["model_dir"]), task_dir, tasks, cfg, out, progress=meter, **reading)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    items = items_scored(out / "lm_eval_results.json")
    random = random_baselines(suite, tasks, cfg.limit)
    table = scores_markdown(scores, items, random)
    (out / "scores.md").write_text(table + "\n")
    (out / "scores.json").write_text(json.dumps(scores, indent=2))
    log("\n" + table)
    return {
        "stage": model.meta.get("stage"),
        "model_dir": model.meta["model_dir"],
        "scores": scores,
        "items": items,
        "random_baseline": random,
        "random_accuracy": suite.meta["random_accuracy"],
        **({"beyond": config.beyond.model_dump()} if config.beyond is not None else {}),
    }
