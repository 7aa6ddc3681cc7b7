"""Evaluation: cloze tasks from the held-out splits, passkey retrieval, contamination, lm-eval.

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
1 / choices over its items; 0 for exact match), so a score on 20 items reads as what it is.
`evaluate` logs items done per task and an ETA while lm-eval runs (evals/lm.py `EvalProgress`)
and reports the same as a progress artifact.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from infra.files import write_atomic
from pipeline.artifact import Artifact, operational
from pipeline.step import step
from tasks.sources import read_shards

CLOZE_TASKS = ("prose_cloze", "code_cloze", "arithmetic_cloze")


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

    def for_suite(self) -> EvalConfig:
        """This section as the eval_suite step sees it: the fields that only say how models are
        evaluated are at their defaults, so changing them does not rebuild the suite."""
        return self.model_copy(
            update={f: type(self).model_fields[f].default for f in (*_RUN_FIELDS, "long_context_cloze")}
        )

    def for_run(self) -> EvalConfig:
        """This section as the evaluate step sees it: only the fields that say how models are
        evaluated; the suite's fields are at their defaults (the suite input carries them)."""
        keep = set(_RUN_FIELDS)  # long_context_cloze reaches the step as EvalSpec.cloze
        return self.model_copy(
            update={f: type(self).model_fields[f].default for f in type(self).model_fields if f not in keep}
        )


# EvalConfig fields the evaluate step uses and the eval_suite step does not.
_RUN_FIELDS = ("lm_eval_tasks", "batch_size", "device", "limit")


# --- building tasks -------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


def prose_items(docs: Sequence[str], cfg: EvalConfig, rng: random.Random) -> list[dict[str, Any]]:
    """Context of `context_words`, gold = the next words, distractors = other docs' passages."""
    need = cfg.context_words + cfg.continuation_words
    passages = []
    for text in docs:
        words = _words(text)
        for start in range(0, len(words) - need + 1, need * 4):
            passages.append(words[start : start + need])
    rng.shuffle(passages)
    items = []
    for i, words in enumerate(passages[: cfg.items_per_task]):
        others = [p for j, p in enumerate(passages) if j != i]
        if len(others) < cfg.choices - 1:
            break
        distractors = [" ".join(p[cfg.context_words :]) for p in rng.sample(others, cfg.choices - 1)]
        items.append(
            _item(" ".join(words[: cfg.context_words]), " ".join(words[cfg.context_words :]), distractors, rng)
        )
    return items


def code_items(docs: Sequence[str], cfg: EvalConfig, rng: random.Random) -> list[dict[str, Any]]:
    """Context = `code_context_lines` lines, gold = the next non-empty line, distractors = lines
    from elsewhere of similar length."""
    windows: list[tuple[str, str]] = []
    pool: list[str] = []
    for text in docs:
        lines = text.splitlines()
        pool += [ln for ln in lines if len(ln.strip()) > 10]
        for start in range(0, len(lines) - cfg.code_context_lines - 1, cfg.code_context_lines * 5):
            target = lines[start + cfg.code_context_lines]
            if len(target.strip()) > 10:
                windows.append(("\n".join(lines[start : start + cfg.code_context_lines]) + "\n", target))
    rng.shuffle(windows)
    items = []
    for context, gold in windows[: cfg.items_per_task]:
        candidates = [ln for ln in rng.sample(pool, min(len(pool), 50)) if ln != gold]
        candidates.sort(key=lambda ln: abs(len(ln) - len(gold)))
        if len(candidates) < cfg.choices - 1:
            continue
        items.append(_item(context, gold, candidates[: cfg.choices - 1], rng, delimiter=""))
    return items


_ANSWER = re.compile(r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S)


def _wrong_numbers(answer: int, k: int, rng: random.Random) -> list[str]:
    candidates = {answer + d for d in (-10, -2, -1, 1, 2, 10, 100)} | {int(str(abs(answer))[::-1] or 0)}
    candidates.discard(answer)
    picked = rng.sample(sorted(candidates), min(k, len(candidates)))
    return [str(n) for n in picked]


def arithmetic_items(docs: Sequence[str], cfg: EvalConfig, rng: random.Random) -> list[dict[str, Any]]:
    """The worked solution up to its final result; choices = the right number and near misses."""
    items = []
    for text in docs:
        m = _ANSWER.match(text.strip())
        if not m:
            continue
        answer, solution = m["answer"], m["solution"]
        cut = solution.rfind(answer)
        if cut <= 0:
            continue
        context = f"Problem: {m['problem']}\nSolution: {solution[:cut].rstrip()}"
        items.append(_item(context, answer, _wrong_numbers(int(answer), cfg.choices - 1, rng), rng))
        if len(items) >= cfg.items_per_task:
            break
    return items


_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ").split()


def passkey_items(length_words: int, cfg: EvalConfig, rng: random.Random) -> list[dict[str, Any]]:
    """A pass key hidden at a random depth in `length_words` words of filler."""
    items = []
    for _ in range(cfg.passkey_items):
        key = rng.randint(10000, 99999)
        filler = [_FILLER[i % len(_FILLER)] for i in range(length_words)]
        depth = rng.randint(0, length_words)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key.".split()
        words = filler[:depth] + needle + filler[depth:]
        context = " ".join(words) + "\nWhat is the pass key? The pass key is"
        wrong = [str(k) for k in rng.sample(range(10000, 100000), cfg.choices - 1) if k != key]
        items.append(_item(context, str(key), wrong[: cfg.choices - 1], rng))
    return items


def _item(context: str, gold: str, distractors: list[str], rng: random.Random, delimiter: str = " ") -> dict[str, Any]:
    choices = [gold, *distractors]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "gold": choices.index(gold), "delimiter": delimiter}


def stage_tasks(cfg: EvalConfig, suite: Artifact, long_context: bool, cloze: bool = True) -> list[str]:
    """What to run on a model: every task of the suite but passkey retrieval (the cloze tasks,
    and the exact-match task of a post-training suite) unless `cloze` is off, passkey retrieval
    after context extension, and the recipe's extra lm-eval tasks."""
    built = list(suite.meta.get("tasks", {}))
    short = [t for t in built if not t.startswith("passkey_")] if cloze else []
    passkey = [t for t in built if t.startswith("passkey_")] if long_context else []
    return [*short, *passkey, *cfg.lm_eval_tasks]


def task_yaml(name: str, data_file: Path, delimiter: str) -> str:
    """An lm-eval task over a local JSONL file (offline: `dataset_path: json`)."""
    return "\n".join(
        [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data_file))}",
            "test_split: test",
            "output_type: multiple_choice",
            'doc_to_text: "{{context}}"',
            'doc_to_choice: "{{choices}}"',
            "doc_to_target: gold",
            f"target_delimiter: {json.dumps(delimiter)}",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "  - metric: acc_norm",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


# Generation (exact match) task for chat models: the ChatML prompt our tokenizer's template
# renders is written into the prompt itself (not lm-eval's --apply_chat_template), so the task
# file alone reproduces the score and a base model sees the same string; generation stops at the
# end of the assistant turn and the final `Answer: N` is compared with the known answer.
CHAT_PROMPT = "<|im_start|>user\n{{problem}}<|im_end|>\n<|im_start|>assistant\n"
GENERATION_TASK = "arithmetic_exact"
ANSWER_PATTERN = r"Answer:\s*(-?\d+)"  # the final answer the worked solutions end with


def arithmetic_generation_items(docs: Sequence[str], n: int) -> list[dict[str, Any]]:
    """Held-out math problems as {problem, answer} for the exact-match generation task."""
    items = []
    for text in docs:
        m = _ANSWER.match(text.strip())
        if m:
            items.append({"problem": m["problem"].strip(), "answer": m["answer"]})
        if len(items) >= n:
            break
    return items


def generation_task_yaml(name: str, data_file: Path, max_gen_toks: int = 48) -> str:
    """An lm-eval `generate_until` task: greedy answer, exact match on the final integer."""
    return "\n".join(
        [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data_file))}",
            "test_split: test",
            "output_type: generate_until",
            f"doc_to_text: {json.dumps(CHAT_PROMPT)}",
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]',
            f"  max_gen_toks: {max_gen_toks}",
            "  do_sample: false",
            "filter_list:",
            "  - name: answer",
            "    filter:",
            "      - function: regex",
            f"        regex_pattern: {json.dumps(ANSWER_PATTERN)}",
            "      - function: take_first",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


def ngrams(text: str, n: int) -> Iterator[int]:
    words = re.findall(r"\w+", text.lower())
    for i in range(len(words) - n + 1):
        yield hash(" ".join(words[i : i + n]))


def contamination(
    tasks: dict[str, list[dict[str, Any]]], training_texts: Iterable[str], n: int
) -> dict[str, dict[str, float]]:
    """Share of each task's items sharing a word n-gram (context + gold) with training text."""
    item_grams: dict[tuple[str, int], set[int]] = {}
    wanted: set[int] = set()
    for name, items in tasks.items():
        for i, item in enumerate(items):
            text = item["context"] + item["delimiter"] + item["choices"][item["gold"]]
            grams = set(ngrams(text, n))
            item_grams[(name, i)] = grams
            wanted |= grams
    seen: set[int] = set()
    scanned = 0
    for text in training_texts:
        scanned += 1
        seen.update(g for g in ngrams(text, n) if g in wanted)
    report = {}
    for name, items in tasks.items():
        hit = sum(1 for i in range(len(items)) if item_grams[(name, i)] & seen)
        report[name] = {"items": len(items), "contaminated": hit, "rate": hit / len(items) if items else 0.0}
    return report


def _texts(folder: Path, limit: int | None = None) -> Iterator[str]:
    for i, doc in enumerate(read_shards(folder)):
        if limit is not None and i >= limit:
            return
        yield doc["text"]


# --- running lm-eval ------------------------------------------------------------------------


HARNESS_MODELS = ("prefix_sharing", "hf")


def located_tasks(task_dir: Path, out: Path) -> Path:
    """The suite's task YAMLs in `out`, each reading its JSONL where the suite is now.

    A task YAML names its data file by absolute path (lm-eval and `datasets` read a relative one
    against the current directory), so a suite in a moved workspace names the old place: the
    evaluation runs copies pointing at the JSONL beside each YAML, and keeps them (what it ran)."""
    out.mkdir(parents=True, exist_ok=True)
    for yaml_file in sorted(Path(task_dir).glob("*.yaml")):
        data = Path(task_dir) / f"{yaml_file.stem}.jsonl"
        lines = [
            f"    test: {json.dumps(str(data))}" if line.startswith("    test: ") and data.is_file() else line
            for line in yaml_file.read_text(encoding="utf-8").splitlines()
        ]
        write_atomic(out / yaml_file.name, "\n".join(lines) + "\n")
    return out


def run_lm_eval(
    model_dir: Path,
    task_dir: Path | None,
    tasks: Sequence[str],
    cfg: EvalConfig,
    out: Path,
    harness_model: str = "prefix_sharing",
    progress: Any = None,
) -> dict[str, dict[str, float]]:
    """Scores per task from lm-eval: {task: {acc, acc_stderr, acc_norm, ...}}; lm-eval's own
    results (configs, versions, n-shot, n-samples, model args, environment) go to
    `out/lm_eval_results.json`, in lm-eval's format (what `lm_eval --output_path` writes).

    `harness_model` "prefix_sharing" (default) is lm-eval's `hf` model with each shared context
    scored once (evals/lm.py, same scores); "hf" is lm-eval's stock `hf` model.
    `progress`: a `evals.lm.EvalProgress` (prefix_sharing only) that logs items done."""
    import lm_eval
    import lm_eval.models  # noqa: F401  (registers the built-in `hf` model before any lookup)
    import torch
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    if harness_model not in HARNESS_MODELS:
        raise ValueError(f"harness_model must be one of {HARNESS_MODELS}, got {harness_model!r}")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    hub = [t for t in tasks if t in cfg.lm_eval_tasks]
    task_dir = located_tasks(task_dir, out / "tasks") if task_dir else None
    manager = TaskManager(include_path=str(task_dir) if task_dir else None, include_defaults=bool(hub))
    # The device goes beside the model args, as lm-eval's CLI passes `--device`: the recorded
    # `model_args` then paste into `lm_eval run --model hf --model_args ... --device ...` (with a
    # `device=` inside them lm-eval's CLI, whose --device defaults to cuda:0, passes it twice).
    model_args = {"pretrained": str(model_dir), "dtype": "float32"}
    if harness_model == "hf":
        model = "hf"
    else:
        from evals.lm import PrefixSharingLM

        # An instance, not a registry name: nothing global is added per call.
        model = PrefixSharingLM(**model_args, device=device, batch_size=cfg.batch_size, progress=progress)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=",".join(f"{k}={v}" for k, v in model_args.items()),
        device=device,
        tasks=list(tasks),
        task_manager=manager,
        batch_size=cfg.batch_size,
        limit=cfg.limit,
        log_samples=False,
    )
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        scores[task] = {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and "," in k
            and not (isinstance(v, float) and v != v)
        }
    results["config"]["harness_model"] = harness_model
    (out / "lm_eval_results.json").write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    return scores


# One metric per task: what the task is built to measure (see the module docstring).
_HEADLINE = {"arithmetic_cloze": "acc", GENERATION_TASK: "exact_match"}


def headline_metric(task: str, metrics: Iterable[str]) -> str | None:
    """The one metric a task is reported by (None when it has none of ours)."""
    have = set(metrics)
    wanted = _HEADLINE.get(task) or ("acc" if task.startswith("passkey_") else None)
    if wanted in have:
        return wanted
    return next((m for m in ("exact_match", "acc_norm", "acc") if m in have), None)


def random_baselines(suite: Artifact, tasks: Sequence[str], limit: int | None) -> dict[str, float | None]:
    """Per task, the score of guessing: the mean of 1 / choices over the items lm-eval scores
    (the first `limit`), 0 for exact match; None for hub tasks (their items are not here)."""
    task_dir = Path(suite.meta["task_dir"])
    out: dict[str, float | None] = {}
    for task in tasks:
        data = task_dir / f"{task}.jsonl"
        if task == GENERATION_TASK:
            out[task] = 0.0
        elif data.is_file():
            rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line]
            rows = rows[:limit] if limit else rows
            out[task] = sum(1 / len(r["choices"]) for r in rows) / len(rows) if rows else None
        else:
            out[task] = None
    return out


def items_scored(results_file: Path) -> dict[str, int]:
    """Items lm-eval scored per task, from its results file (`n-samples`, effective)."""
    try:
        samples = json.loads(results_file.read_text(encoding="utf-8")).get("n-samples", {})
    except (OSError, ValueError):
        return {}
    return {t: int(n["effective"]) for t, n in samples.items() if isinstance(n, dict) and "effective" in n}


def scores_markdown(scores: dict[str, dict[str, float]], items: dict[str, int], random: dict[str, float | None]) -> str:
    """One row per task: its headline metric, value ± stderr, items, random baseline."""
    lines = ["| task | metric | score | ± stderr | items | random |", "|---|---|---|---|---|---|"]
    for task, metrics in sorted(scores.items()):
        metric = headline_metric(task, metrics)
        if metric is None:
            continue
        se, base = metrics.get(f"{metric}_stderr"), random.get(task)
        lines.append(
            f"| {task} | {metric} | {metrics[metric]:.3f} | "
            f"{'-' if se is None else f'{se:.3f}'} | {items.get(task, '-')} | "
            f"{'-' if base is None else f'{base:.3f}'} |"
        )
    return "\n".join(lines)


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
    seed of item sampling, and for post-training suites the exact-match generation task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eval: EvalConfig
    seed: int = 0
    generation_items: int = Field(default=0, ge=0)  # arithmetic exact-match items (0: none)
    max_gen_tokens: int = Field(default=48, gt=0)  # tokens generated per answer


class EvalSpec(BaseModel):
    """The evaluate step's config: how to score a model, and whether it is long-context (passkey
    retrieval runs only then). The tasks come from the suite input, not from the flow."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eval: EvalConfig
    long_context: bool = False  # a context-extension stage: passkey retrieval runs too
    cloze: bool = True  # the suite's short tasks run too (`eval.long_context_cloze` after extension)

    @classmethod
    def of(cls, eval: EvalConfig, long_context: bool = False) -> EvalSpec:
        return cls(eval=eval.for_run(), long_context=long_context, cloze=not long_context or eval.long_context_cloze)


@step("eval_suite", version=2, kind="eval", resource="data", isolate=True, retries=1)
def eval_suite(
    config: SuiteSpec, heldout: tuple[Artifact, ...], train: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """The eval suite from the held-out splits of the `heldout` corpora: every task's JSONL + YAML
    in `out/tasks`, and the contamination report against the training text of the `train`
    corpora; with `generation_items`, also the exact-match generation task (for post-trained chat
    models)."""
    cfg = config.eval
    rng = random.Random(f"eval-suite:{config.seed}")
    by_domain: dict[str, list[str]] = {"web": [], "code": [], "math": []}
    for art in heldout:
        by_domain[art.meta["domain"]].extend(_texts(art.path / "heldout"))
    tasks = {
        "prose_cloze": prose_items(by_domain["web"], cfg, rng),
        "code_cloze": code_items(by_domain["code"], cfg, rng),
        "arithmetic_cloze": arithmetic_items(by_domain["math"], cfg, rng),
    }
    for length in cfg.passkey_lengths:
        tasks[f"passkey_{length}"] = passkey_items(length, cfg, rng)
    tasks = {k: v for k, v in tasks.items() if v}
    if not tasks:
        raise ValueError("no eval items could be built: the held-out splits are empty")
    task_dir = out / "tasks"
    task_dir.mkdir(parents=True, exist_ok=True)
    for name, items in tasks.items():
        data = task_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
        (task_dir / f"{name}.yaml").write_text(task_yaml(name, data, items[0]["delimiter"]))
    gen: list[dict[str, Any]] = []
    if config.generation_items:
        gen = arithmetic_generation_items(by_domain["math"], config.generation_items)
        if gen:
            data = task_dir / f"{GENERATION_TASK}.jsonl"
            data.write_text("".join(json.dumps(i) + "\n" for i in gen), encoding="utf-8")
            (task_dir / f"{GENERATION_TASK}.yaml").write_text(
                generation_task_yaml(GENERATION_TASK, data, config.max_gen_tokens)
            )
    cloze = {k: v for k, v in tasks.items() if not k.startswith("passkey_")}
    report = contamination(
        cloze,
        (t for art in train for t in _texts(art.path / "train", cfg.contamination_max_docs)),
        cfg.contamination_ngram,
    )
    (out / "contamination.json").write_text(json.dumps(report, indent=2))
    for name, r in report.items():
        log(
            f"eval suite: {name}: {r['items']} items, {r['contaminated']} share a "
            f"{cfg.contamination_ngram}-gram with training data ({r['rate']:.1%})"
        )
    if gen:
        tasks[GENERATION_TASK] = gen
    return {
        "tasks": {k: len(v) for k, v in tasks.items()},
        "choices": cfg.choices,
        "random_accuracy": 1.0 / cfg.choices,
        "contamination": {k: round(v["rate"], 4) for k, v in report.items()},
        "task_dir": str(task_dir),
    }


@step("evaluate", version=2, kind="eval", publish=publish_eval, resource="eval")
def evaluate(
    config: EvalSpec, model: Artifact, suite: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """lm-eval over one exported `model` on the tasks of the `suite` it should run
    (`stage_tasks`): scores, items and random baselines per task."""
    from evals.lm import EvalProgress

    cfg = config.eval
    tasks = stage_tasks(cfg, suite, config.long_context, config.cloze)
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
    meter = EvalProgress(log, progress, expected)
    scores = run_lm_eval(Path(model.meta["model_dir"]), Path(suite.meta["task_dir"]), tasks, cfg, out, progress=meter)
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
    }
