"""Running lm-eval on an exported model over the eval suite, and reading its results back:
which tasks a model runs, each task's headline metric, the random baselines, the items scored.

`cfg` is the recipe's `eval` section (tasks/evaluate.py `EvalConfig`); the `evaluate` step calls
`run_lm_eval`, the run report reads `headline_metric` and `items_scored`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from evals.suite import GENERATION_TASK, SUITE_TASK, suite_task_yaml
from infra.files import write_atomic
from pipeline.artifact import Artifact


def stage_tasks(cfg: Any, suite: Artifact, long_context: bool, cloze: bool = True) -> list[str]:
    """What to run on a model: every task of the suite but passkey retrieval (the cloze tasks,
    and the exact-match task of a post-training suite) unless `cloze` is off, passkey retrieval
    after context extension, and the recipe's extra lm-eval tasks."""
    built = list(suite.meta.get("tasks", {}))
    short = [t for t in built if not t.startswith("passkey_")] if cloze else []
    passkey = [t for t in built if t.startswith("passkey_")] if long_context else []
    return [*short, *passkey, *cfg.lm_eval_tasks]


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


class ForeignTaskFile(ValueError):
    """A task file of the eval suite that is not what the suite's builders write (changed,
    planted, or not a regular file): lm-eval never sees it."""


_DATA_LINE = re.compile(r'^    test: ("[^\n]*")$', re.M)
_MAX_GEN = re.compile(r"^  max_gen_toks: ([1-9][0-9]{0,5})$", re.M)
_MAX_TASK_FILE = 1 << 20  # our task YAMLs are under 2 KiB


def suite_task_files(
    task_dir: Path, tasks: Sequence[str], suite_tasks: Iterable[str], out: Path, log: Callable[[str], None] = print
) -> Path:
    """The suite's task YAMLs for `tasks`, regenerated into `out` (a private folder the caller
    made: it becomes lm-eval's include_path) by the builders the `eval_suite` step uses
    (`evals.suite.suite_task_yaml`), each reading the JSONL in `task_dir` where the suite is now.

    Each YAML in `task_dir` must equal, byte for byte, what the builder writes for that task and
    the data path and `max_gen_toks` it names (the two values that vary between suites; a moved
    workspace changes the path); anything else raises `ForeignTaskFile` naming the file, before
    lm-eval runs. What `out` holds is our regeneration, never the suite's bytes, so a
    `!function`, an `include:` or a Jinja template beyond `{{field}}` never reaches lm-eval.
    Other files in `task_dir` (a planted YAML, a `.py` beside it, the YAMLs of tasks not run) are
    ignored: never copied, never an include path; the unknown ones are logged by name."""
    task_dir = Path(task_dir)
    for name in tasks:
        if not SUITE_TASK.fullmatch(name):
            raise ForeignTaskFile(f"task {name!r} of suite {task_dir} is not one the eval suite builds")
        yaml_file, data = task_dir / f"{name}.yaml", task_dir / f"{name}.jsonl"
        for file in (yaml_file, data):
            if file.is_symlink() or not file.is_file():
                raise ForeignTaskFile(f"{file}: not a regular file (eval suite task {name}); nothing evaluated")
        if yaml_file.stat().st_size > _MAX_TASK_FILE:
            raise ForeignTaskFile(f"{yaml_file}: over {_MAX_TASK_FILE} bytes, not a task file the eval suite writes")
        text = yaml_file.read_bytes().decode("utf-8", errors="replace")
        written, gen = _DATA_LINE.search(text), _MAX_GEN.search(text)
        max_gen = int(gen[1]) if gen else 48
        try:
            path = json.loads(written[1]) if written else None
            expected = suite_task_yaml(name, Path(path), max_gen) if isinstance(path, str) and path else None
        except ValueError:
            expected = None
        if text != expected:
            raise ForeignTaskFile(
                f"{yaml_file} is not the task file the eval suite writes for {name} (changed or planted); "
                "nothing evaluated"
            )
        (out / yaml_file.name).write_text(suite_task_yaml(name, data, max_gen), encoding="utf-8")
    known = {f"{n}{ext}" for n in suite_tasks for ext in (".yaml", ".jsonl")}
    extra = sorted(p.name for p in task_dir.iterdir() if p.name not in known)
    if extra:
        log(
            f"eval suite {task_dir}: ignored {', '.join(map(repr, extra))}: not files of the suite's tasks "
            "(lm-eval reads only task files regenerated by the suite's builders)"
        )
    return out


def run_lm_eval(
    model_dir: Path,
    task_dir: Path | None,
    tasks: Sequence[str],
    cfg: Any,
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
    import lm_eval.models  # noqa: F401  (registers the built-in `hf` model before any lookup)
    import torch

    if harness_model not in HARNESS_MODELS:
        raise ValueError(f"harness_model must be one of {HARNESS_MODELS}, got {harness_model!r}")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    hub = [t for t in tasks if t in cfg.lm_eval_tasks]
    # lm-eval reads the task files from a fresh private folder (mode 0700, removed after the run),
    # never from the workspace: no other account can swap a file between this copy and lm-eval's
    # read. `out/tasks` keeps a copy of what ran, for people.
    private = Path(tempfile.mkdtemp(prefix="smollm3-lm-eval-tasks-"))
    try:
        return _run(model_dir, task_dir, private, hub, tasks, cfg, out, harness_model, device, progress)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _run(model_dir, task_dir, private, hub, tasks, cfg, out, harness_model, device, progress):
    """`run_lm_eval` with its task files in the private folder `private`."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    if task_dir:
        located_tasks(task_dir, private)
        located_tasks(private, out / "tasks")
    manager = TaskManager(include_path=str(private) if task_dir else None, include_defaults=bool(hub))
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
