"""The eval_suite and evaluate steps: a suite built from held-out corpora (tasks, contamination),
and a real model evaluated on it (progress, one metric per task, items, random baselines)."""

from __future__ import annotations

import json
import shutil

import pytest

from curation.source_kinds import SourceConfig
from evals.harness import stage_tasks
from pipeline.artifact import Artifact
from tasks.evaluate import EvalConfig, SuiteSpec, eval_suite
from tasks.sources import SourceSpec, source
from tests.evals.tiny_model import export_tiny_hf_model


def _corpus(tmp_path, name, uri, domain, n):
    out = tmp_path / name
    cfg = SourceConfig(name=name, uri=uri, domain=domain, max_documents=n, held_out_fraction=0.3)
    meta = source(SourceSpec(source=cfg), out=out, log=lambda _: None)
    return Artifact(kind="corpus", uri=str(out), fingerprint=name * 8, meta=meta)


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
    return export_tiny_hf_model(tmp_path_factory.mktemp("hf"))


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


@pytest.mark.parametrize("yarn", [False, True])
def test_evaluate_past_the_trained_length_reads_the_model_at_the_factor_with_or_without_yarn(
    tmp_path, tiny_hf_model, yarn
):
    """The last stage read at `eval.beyond_factor` x its length: only the passkey_beyond task,
    lm-eval's window at the factor x the trained length, YaRN recorded when applied."""
    from model.config import RopeScaling
    from tasks.evaluate import EvalSpec, evaluate

    sources = [_corpus(tmp_path, "prose", "builtin:prose", "web", 40)]
    cfg = EvalConfig(
        items_per_task=4,
        passkey_lengths=(10,),
        passkey_items=2,
        beyond_factor=2.0,
        beyond_passkey_words=24,
        batch_size=4,
        device="cpu",
        lm_eval_tasks=("hellaswag",),
    )
    suite_meta = eval_suite(SuiteSpec(eval=cfg.for_suite()), heldout=sources, train=sources, out=tmp_path / "suite")
    assert "passkey_beyond_24" in suite_meta["tasks"]
    suite = Artifact(kind="eval", uri=str(tmp_path / "suite"), fingerprint="s" * 64, meta=suite_meta)
    model = Artifact(
        kind="hf_model",
        uri=str(tiny_hf_model.parent),
        fingerprint="m" * 64,
        meta={"stage": "long2", "model_dir": str(tiny_hf_model)},
    )
    spec = EvalSpec.past_training(cfg, trained_len=64, yarn=yarn)
    assert spec.eval.lm_eval_tasks == ()  # hub tasks are the stage evaluation's, not this one's
    lines: list[str] = []
    out = tmp_path / "eval"
    out.mkdir()
    meta = evaluate(spec, model, suite, out=out, log=lines.append)
    assert set(meta["scores"]) == {"passkey_beyond_24"} and meta["items"] == {"passkey_beyond_24": 2}
    assert meta["beyond"] == {"trained_len": 64, "factor": 2.0, "yarn": yarn}
    saved = json.loads((out / "lm_eval_results.json").read_text())
    assert "max_length=128" in saved["config"]["model_args"]
    assert any("read at 128 tokens (2 x the trained 64)" in line for line in lines)
    if yarn:
        assert saved["config"]["rope_scaling"]["factor"] == 2.0
        assert saved["config"]["rope_scaling"]["original_max_position_embeddings"] == 64
        assert RopeScaling(**saved["config"]["rope_scaling"]) == RopeScaling(2.0, 64)
    else:
        assert "rope_scaling" not in saved["config"]


def test_the_evaluation_past_the_trained_length_needs_its_passkey_length():
    with pytest.raises(ValueError, match="eval.beyond_factor=2.0 needs eval.beyond_passkey_words"):
        EvalConfig(beyond_factor=2.0)
