"""Running lm-eval over suite tasks (evals/harness.py): our prefix-sharing model against lm-eval's
stock `hf`, the generation task, progress, and a suite evaluated after its workspace moved."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from evals.benchmarks.arithmetic_cloze import arithmetic_items
from evals.benchmarks.eval_task import task_yaml
from evals.benchmarks.passkey import passkey_items
from evals.harness import run_lm_eval
from tasks.evaluate import EvalConfig, SuiteSpec
from tests.evals.tiny_model import export_tiny_hf_model


def _asked(think: bool = False):
    """Questions as the eval suite asks them (the chat prompt in a reasoning mode)."""
    return lambda question: SuiteSpec(eval=EvalConfig()).chat_prompt(question, think=think)


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A randomly initialised SmolLM3 exported with a small trained BPE tokenizer."""
    return export_tiny_hf_model(tmp_path_factory.mktemp("hf"))


def _write_task(task_dir, name, items, delimiter=" "):
    (task_dir / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (task_dir / f"{name}.yaml").write_text(task_yaml(name, task_dir / f"{name}.jsonl", delimiter))


@pytest.mark.slow
def test_lm_eval_scores_equal_the_stock_hf_model(tmp_path, tiny_hf_model):
    """The default path (each shared context scored once) gives lm-eval's `hf` scores: acc,
    acc_norm and their stderr, on cloze and passkey tasks; repeated calls in one process agree."""
    import logging

    rng = random.Random(2)
    docs = [
        f"Problem: What is {a} + {a + 3}?\nSolution: {a} + {a + 3} = {2 * a + 3}.\nAnswer: {2 * a + 3}"
        for a in range(10, 40)
    ]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    _write_task(task_dir, "arith_test", arithmetic_items(docs, EvalConfig(), rng))
    _write_task(task_dir, "passkey_test", passkey_items(60, EvalConfig(passkey_items=6), rng))
    cfg = EvalConfig(batch_size=4, device="cpu")
    tasks = ["arith_test", "passkey_test"]
    (tmp_path / "hf").mkdir()
    stock = run_lm_eval(tiny_hf_model, task_dir, tasks, cfg, tmp_path / "hf", harness_model="hf")
    handlers = len(logging.getLogger("lm_eval").handlers)
    ours = run_lm_eval(tiny_hf_model, task_dir, tasks, cfg, tmp_path)
    assert set(ours) == set(stock) == set(tasks)
    for task in tasks:
        assert set(ours[task]) >= {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr"}
        assert ours[task] == pytest.approx(stock[task], abs=1e-9)
    assert run_lm_eval(tiny_hf_model, task_dir, tasks, cfg, tmp_path) == ours
    assert len(logging.getLogger("lm_eval").handlers) == handlers
    # lm-eval's own results file: the whole dict simple_evaluate returns, JSON.
    saved = json.loads((tmp_path / "lm_eval_results.json").read_text())
    assert saved["results"]["arith_test"]["acc,none"] == ours["arith_test"]["acc"]
    assert saved["n-samples"]["arith_test"]["effective"] == 30
    assert {"configs", "versions", "n-shot", "higher_is_better"} <= set(saved)
    assert saved["configs"]["passkey_test"]["dataset_path"] == "json"
    assert saved["config"]["model_args"].startswith(f"pretrained={tiny_hf_model}")
    assert saved["config"]["harness_model"] == "prefix_sharing" and saved["config"]["device"] == "cpu"
    # the environment report in every results file, computed once per process
    first = json.loads((tmp_path / "hf" / "lm_eval_results.json").read_text())["pretty_env_info"]
    assert saved["pretty_env_info"] == first and "PyTorch version" in first
    # The recorded model args paste into lm-eval's CLI, which passes its --device (default
    # cuda:0, here cpu) beside them: what `lm_eval run --model hf --model_args ARGS --device cpu`
    # builds.
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.models.huggingface import HFLM

    assert EvaluatorConfig().device is not None  # the CLI always passes a device
    for results in (saved, json.loads((tmp_path / "hf" / "lm_eval_results.json").read_text())):
        args = results["config"]["model_args"]
        assert "device=" not in args, args
        lm = HFLM.create_from_arg_string(args, {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
        assert str(lm.device) == "cpu"
    with pytest.raises(ValueError, match="harness_model must be one of"):
        run_lm_eval(tiny_hf_model, task_dir, tasks, cfg, tmp_path, harness_model="vllm")


def test_the_environment_report_runs_its_commands_once_per_process(monkeypatch):
    """lm-eval adds torch's environment report to every result; after the first, an evaluation
    in the same process runs none of its commands (`pip list`, compilers, GPU driver) and adds
    the same text."""
    import subprocess

    from lm_eval.loggers.utils import add_env_info
    from torch.utils import collect_env

    from evals.harness import environment_report_once

    original = getattr(collect_env.get_pretty_env_info, "__wrapped__", collect_env.get_pretty_env_info)
    monkeypatch.setattr(collect_env, "get_pretty_env_info", original)
    started = []
    real = subprocess.Popen

    class Counting(real):
        def __init__(self, *args, **kwargs):
            started.append(args[0] if args else kwargs.get("args"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Counting)
    environment_report_once()
    environment_report_once()  # a second install wraps nothing again
    first, second = {}, {}
    add_env_info(first)
    ran = len(started)
    add_env_info(second)
    assert ran > 0 and first["pretty_env_info"] == second["pretty_env_info"]
    assert [str(c) for c in started[ran:]] == [str(c) for c in started[ran:] if "git" in str(c)]


def test_generation_task_runs_on_both_paths(tmp_path, tiny_hf_model):
    """The exact-match generation task (chat models) goes through lm-eval's `generate_until`."""
    from evals.benchmarks.arithmetic_exact import arithmetic_generation_items, generation_task_yaml

    docs = [f"Problem: What is {a} + 1?\nSolution: {a} + 1 = {a + 1}.\nAnswer: {a + 1}" for a in range(5)]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "g.jsonl").write_text(
        "".join(json.dumps(i) + "\n" for i in arithmetic_generation_items(docs, 5, _asked()))
    )
    (task_dir / "g.yaml").write_text(generation_task_yaml("gen_test", task_dir / "g.jsonl", 6))
    cfg = EvalConfig(batch_size=5, device="cpu")
    ours = run_lm_eval(tiny_hf_model, task_dir, ["gen_test"], cfg, tmp_path)
    assert ours == run_lm_eval(tiny_hf_model, task_dir, ["gen_test"], cfg, tmp_path, harness_model="hf")
    assert 0.0 <= ours["gen_test"]["exact_match"] <= 1.0


@pytest.mark.slow
def test_the_think_mode_task_scores_with_its_think_length_and_closed_share(tmp_path, tiny_hf_model):
    """The think-mode twin (its suite name, its builder's file) gets exact match plus the mean
    think length in tokens (at most the tokens generated) and the share closing the block; the
    generated answers it reads them from stay out of lm-eval's results file, as before."""
    from evals.benchmarks.arithmetic_exact import THINK_TASK, arithmetic_generation_items
    from evals.suite import suite_task_yaml

    docs = [f"Problem: What is {a} + 1?\nSolution: {a} + 1 = {a + 1}.\nAnswer: {a + 1}" for a in range(4)]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    data = task_dir / f"{THINK_TASK}.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in arithmetic_generation_items(docs, 4, _asked(think=True))))
    (task_dir / f"{THINK_TASK}.yaml").write_text(suite_task_yaml(THINK_TASK, data, 6))
    scores = run_lm_eval(tiny_hf_model, task_dir, [THINK_TASK], EvalConfig(batch_size=4, device="cpu"), tmp_path)
    got = scores[THINK_TASK]
    assert 0.0 <= got["exact_match"] <= 1.0
    assert 0.0 <= got["think_tokens"] <= 6 and 0.0 <= got["think_closed"] <= 1.0
    assert "samples" not in json.loads((tmp_path / "lm_eval_results.json").read_text())


def test_generation_progress_counts_generated_answers(tmp_path, tiny_hf_model):
    """Generation requests (lm-eval's own `generate_until`) are counted as they are answered."""
    from evals.benchmarks.arithmetic_exact import arithmetic_generation_items, generation_task_yaml
    from evals.lm import EvalProgress

    docs = [f"Problem: What is {a} + 1?\nSolution: {a} + 1 = {a + 1}.\nAnswer: {a + 1}" for a in range(6)]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "g.jsonl").write_text(
        "".join(json.dumps(i) + "\n" for i in arithmetic_generation_items(docs, 6, _asked()))
    )
    (task_dir / "g.yaml").write_text(generation_task_yaml("gen_test", task_dir / "g.jsonl", 4))
    lines: list[str] = []
    meter = EvalProgress(lines.append, every_pct=50)  # nothing expected: counted as announced
    run_lm_eval(tiny_hf_model, task_dir, ["gen_test"], EvalConfig(batch_size=2, device="cpu"), tmp_path, progress=meter)
    assert [line.split(" |")[0] for line in lines] == ["lm-eval: 3/6 items (50%)", "lm-eval: 6/6 items (100%)"]
    assert meter.done == {"gen_test": 6}


def test_a_moved_suite_is_evaluated_from_where_it_is_now(tmp_path):
    """Task YAMLs name their JSONL by absolute path: after the workspace moved (the old place
    deleted), the evaluation's copies read the JSONL beside each YAML, and lm-eval loads them."""
    from evals.harness import located_tasks

    old = tmp_path / "old" / "eval_suite" / "abc" / "tasks"
    old.mkdir(parents=True)
    rows = [{"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0, "delimiter": ""}]
    (old / "toy_cloze.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (old / "toy_cloze.yaml").write_text(task_yaml("toy_cloze", old / "toy_cloze.jsonl", ""))
    new = tmp_path / "new"
    shutil.move(tmp_path / "old", new)
    located = located_tasks(new / "eval_suite" / "abc" / "tasks", tmp_path / "eval" / "tasks")
    text = (located / "toy_cloze.yaml").read_text()
    assert json.dumps(str(new / "eval_suite" / "abc" / "tasks" / "toy_cloze.jsonl")) in text
    assert str(tmp_path / "old") not in text
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(located), include_defaults=False).load_task_or_group(["toy_cloze"])
    (doc,) = list(next(iter(task.values())).test_docs())
    assert doc["context"] == "1 + 1 ="
