"""Eval suite: cloze items from held-out text, passkeys, contamination, and lm-eval on a real model."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from curation.source_kinds import SourceConfig
from evals.harness import run_lm_eval, stage_tasks
from evals.suite import arithmetic_items, contamination, passkey_items, prose_items
from pipeline.artifact import Artifact
from tasks.evaluate import EvalConfig, SuiteSpec, eval_suite
from tasks.sources import SourceSpec, source


def _corpus(tmp_path, name, uri, domain, n):
    out = tmp_path / name
    cfg = SourceConfig(name=name, uri=uri, domain=domain, max_documents=n, held_out_fraction=0.3)
    meta = source(SourceSpec(source=cfg), out=out, log=lambda _: None)
    return Artifact(kind="corpus", uri=str(out), fingerprint=name * 8, meta=meta)


def test_arithmetic_items_hold_the_right_answer(tmp_path):
    rng = random.Random(0)
    docs = [
        "Problem: What is 12 + 30?\nSolution: 12 + 30 = 42.\nAnswer: 42",
        "Problem: Ada buys 3 books at 5 dollars each. How many dollars does Ada spend?\n"
        "Solution: Each costs 5 dollars, so 3 cost 3 * 5 = 15 dollars.\nAnswer: 15",
    ]
    items = arithmetic_items(docs, EvalConfig(), rng)
    assert [it["choices"][it["gold"]] for it in items] == ["42", "15"]
    assert items[0]["context"].endswith("12 + 30 =") and "42" not in items[0]["context"]
    assert all(len(set(it["choices"])) == 4 for it in items)


def test_prose_and_passkey_items(tmp_path):
    rng = random.Random(1)
    docs = [" ".join(f"w{d}_{i}" for i in range(400)) for d in range(5)]
    cfg = EvalConfig(items_per_task=10)
    items = prose_items(docs, cfg, rng)
    assert len(items) == 10
    for it in items:
        gold = it["choices"][it["gold"]]
        doc = next(d for d in docs if it["context"] in d)
        assert it["context"] + " " + gold in doc  # the gold continues the context
    keys = passkey_items(50, cfg, rng)
    for it in keys:
        assert f"The pass key is {it['choices'][it['gold']]}." in it["context"]


def test_contamination_finds_planted_overlap():
    items = {
        "t": [
            {
                "context": "the quick brown fox jumps over the lazy",
                "choices": ["dog today", "cat"],
                "gold": 0,
                "delimiter": " ",
            },
            {
                "context": "entirely fresh words never seen in training",
                "choices": ["ok", "no"],
                "gold": 0,
                "delimiter": " ",
            },
        ]
    }
    report = contamination(items, ["yesterday the quick brown fox jumps over the lazy dog today again"], n=8)
    assert report["t"] == {"items": 2, "contaminated": 1, "rate": 0.5}


def test_eval_suite_writes_lm_eval_tasks(tmp_path):
    sources = [
        _corpus(tmp_path, "prose", "builtin:prose", "web", 60),
        _corpus(tmp_path, "code", "builtin:code", "code", 40),
        _corpus(tmp_path, "math", "builtin:math", "math", 300),
    ]
    cfg = EvalConfig(items_per_task=15, passkey_lengths=(50,), passkey_items=4)
    # "Training" data that is a copy of the math held-out split: every arithmetic item leaks.
    leaked = tmp_path / "leaked"
    shutil.copytree(tmp_path / "math" / "heldout", leaked / "train")
    training = [*sources, Artifact(kind="corpus", uri=str(leaked), fingerprint="l" * 64, meta={})]
    meta = eval_suite(SuiteSpec(eval=cfg), heldout=sources, train=training, out=tmp_path / "suite", log=lambda _: None)
    assert set(meta["tasks"]) == {"prose_cloze", "code_cloze", "arithmetic_cloze", "passkey_50"}
    assert meta["contamination"]["arithmetic_cloze"] == 1.0
    clean = eval_suite(SuiteSpec(eval=cfg), heldout=sources, train=sources, out=tmp_path / "suite2", log=lambda _: None)
    assert clean["contamination"]["prose_cloze"] < 0.5
    task_dir = tmp_path / "suite" / "tasks"
    assert "dataset_path: json" in (task_dir / "prose_cloze.yaml").read_text()
    suite = Artifact(kind="eval", uri=str(tmp_path / "suite"), fingerprint="s" * 64, meta=meta)
    assert stage_tasks(cfg, suite, long_context=False) == ["prose_cloze", "code_cloze", "arithmetic_cloze"]
    assert "passkey_50" in stage_tasks(cfg, suite, long_context=True)


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A randomly initialised SmolLM3 exported with a small trained BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    root = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"Problem: What is {i} + {i + 1}? Answer: {2 * i + 1}" for i in range(300)]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    model = SmolLM3(ModelConfig.tiny(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2))
    model.init_weights(seed=0)
    return export_hf(model, root / "model", tokenizer_dir=root / "tok", eos_token_id=0)


def _write_task(task_dir, name, items, delimiter=" "):
    from evals.suite import task_yaml

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


def test_generation_task_runs_on_both_paths(tmp_path, tiny_hf_model):
    """The exact-match generation task (chat models) goes through lm-eval's `generate_until`."""
    from evals.suite import arithmetic_generation_items, generation_task_yaml

    docs = [f"Problem: What is {a} + 1?\nSolution: {a} + 1 = {a + 1}.\nAnswer: {a + 1}" for a in range(5)]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "g.jsonl").write_text("".join(json.dumps(i) + "\n" for i in arithmetic_generation_items(docs, 5)))
    (task_dir / "g.yaml").write_text(generation_task_yaml("gen_test", task_dir / "g.jsonl", 6))
    cfg = EvalConfig(batch_size=5, device="cpu")
    ours = run_lm_eval(tiny_hf_model, task_dir, ["gen_test"], cfg, tmp_path)
    assert ours == run_lm_eval(tiny_hf_model, task_dir, ["gen_test"], cfg, tmp_path, harness_model="hf")
    assert 0.0 <= ours["gen_test"]["exact_match"] <= 1.0


def test_evaluate_logs_progress_and_records_one_metric_per_task_with_stderr_items_and_random(tmp_path, tiny_hf_model):
    """`evaluate`'s build on a real suite and model: items done per task and an ETA while lm-eval
    runs, 100% at the end; per task its headline metric ± stderr, items and random baseline;
    lm-eval's own results file beside the scores, readable by lm-eval's own table printer."""
    from lm_eval.utils import make_table

    from tasks.evaluate import EvalSpec, evaluate

    sources = [
        _corpus(tmp_path, "prose", "builtin:prose", "web", 60),
        _corpus(tmp_path, "math", "builtin:math", "math", 300),
    ]
    cfg = EvalConfig(items_per_task=12, passkey_lengths=(30,), passkey_items=3, batch_size=4, device="cpu")
    suite_meta = eval_suite(
        SuiteSpec(eval=cfg), heldout=sources, train=sources, out=tmp_path / "suite", log=lambda _: None
    )
    suite = Artifact(kind="eval", uri=str(tmp_path / "suite"), fingerprint="s" * 64, meta=suite_meta)
    model = Artifact(
        kind="hf_model",
        uri=str(tiny_hf_model.parent),
        fingerprint="m" * 64,
        meta={"stage": "stage1", "model_dir": str(tiny_hf_model)},
    )
    tasks = stage_tasks(cfg, suite, long_context=True)
    lines, percents = [], []
    out = tmp_path / "eval"
    out.mkdir()
    meta = evaluate(
        EvalSpec(eval=cfg, long_context=True), model, suite, out=out, log=lines.append, progress=percents.append
    )

    counts = suite_meta["tasks"]
    assert meta["items"] == {t: counts[t] for t in tasks}
    progress = [line for line in lines if line.startswith("lm-eval: ")]
    assert progress and percents and percents[-1] == 100.0 and percents == sorted(percents)
    total = sum(counts[t] for t in tasks)
    assert progress[-1].startswith(f"lm-eval: {total}/{total} items (100%)")
    assert all(f"{t} {counts[t]}/{counts[t]}" in progress[-1] for t in tasks)
    assert all(" | ETA " in line for line in progress[:-1]) and " | took " in progress[-1]
    # Random baseline: the mean of 1 / choices over the items (arithmetic items may have fewer).
    for task in tasks:
        rows = [json.loads(x) for x in (tmp_path / "suite" / "tasks" / f"{task}.jsonl").read_text().splitlines()]
        assert meta["random_baseline"][task] == pytest.approx(sum(1 / len(r["choices"]) for r in rows) / len(rows))
    table = (out / "scores.md").read_text()
    assert "| prose_cloze | acc_norm |" in table and "| arithmetic_cloze | acc |" in table
    assert f"| passkey_30 | acc | {meta['scores']['passkey_30']['acc']:.3f} | " in table
    saved = json.loads((out / "lm_eval_results.json").read_text())
    assert set(saved["results"]) == set(tasks)
    assert all(t in make_table(saved) for t in tasks)


def test_generation_progress_counts_generated_answers(tmp_path, tiny_hf_model):
    """Generation requests (lm-eval's own `generate_until`) are counted as they are answered."""
    from evals.lm import EvalProgress
    from evals.suite import arithmetic_generation_items, generation_task_yaml

    docs = [f"Problem: What is {a} + 1?\nSolution: {a} + 1 = {a + 1}.\nAnswer: {a + 1}" for a in range(6)]
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "g.jsonl").write_text("".join(json.dumps(i) + "\n" for i in arithmetic_generation_items(docs, 6)))
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
    from evals.suite import task_yaml

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
