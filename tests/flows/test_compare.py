"""Two runs compared (flows/compare.py, `smollm3 compare`): config differences by override path,
both loss curves on one plot, the eval tables side by side with the noise of each difference,
and the comparison published as a Prefect artifact."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path

import pytest

from flows.cli import main
from flows.compare import _score, compare_runs, config_differences, eval_pairs
from flows.recipe import load_recipe
from pipeline.artifact import Artifact
from pipeline.lineage import Lineage, StepRow

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def _stage(root: Path, lr: float) -> Artifact:
    """One real 3-step stage trained by the pretrain step's build."""
    from model.spec import OptimizerConfig, ScheduleSpec, TrainSpec
    from tasks.pretrain import StageSpec, pretrain
    from tests.model.conftest import write_two_source_plan

    plan = write_two_source_plan(root / "plan")
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    spec = TrainSpec(
        stage="stage1",
        steps=3,
        global_batch=8,
        micro_batch=8,
        seq_len=32,
        num_threads=1,
        device="cpu",
        model_overrides={**TINY, "max_seq_len": 64},
        optimizer=OptimizerConfig(lr=lr),
        schedule=ScheduleSpec(kind="wsd", warmup_steps=1, decay_fraction=0.0, total_steps=3),
    )
    folder = root / "pretrain" / "stage1"
    folder.mkdir(parents=True)
    meta = pretrain(StageSpec(spec=spec, threads=1), mixture=mixture, out=folder, log=lambda _: None)
    return Artifact(kind="checkpoint", uri=str(folder), fingerprint=(f"{lr}" * 64)[:64].replace(".", "a"), meta=meta)


def _eval(root: Path, acc: float, stderr: float) -> Artifact:
    folder = root / "evaluate" / "stage1"
    folder.mkdir(parents=True)
    scores = {
        "prose_cloze": {"acc_norm": acc, "acc_norm_stderr": stderr},
        "arithmetic_cloze": {"acc": 0.30, "acc_stderr": 0.046},
    }
    meta = {
        "stage": "stage1",
        "scores": scores,
        "items": {"prose_cloze": 100, "arithmetic_cloze": 100},
        "random_baseline": {"prose_cloze": 0.25, "arithmetic_cloze": 0.25},
    }
    return Artifact(kind="eval", uri=str(folder), fingerprint=(f"e{acc}" * 64)[:64].replace(".", "b"), meta=meta)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A (lr 1e-3) and run B (lr 3e-3, one source capped), each one trained stage and one
    evaluation, recorded in lineage as the runner records them."""
    root = tmp_path_factory.mktemp("compare")
    lineage = Lineage(root / "ws" / "lineage.duckdb")
    now = datetime.now()
    for run_id, lr, extra, acc in (
        ("aaaa1111-run", 1e-3, [], 0.30),
        ("bbbb2222-run", 3e-3, ["sources.math.max_documents=999"], 0.52),
    ):
        recipe = load_recipe("tiny", [f"training.optimizer.lr={lr}", *extra, f"workspace={root / run_id}"])
        lineage.start_run(run_id, "smollm3", "full", "tiny", recipe.model_dump(mode="json"))
        for step, art in (("pretrain", _stage(root / run_id, lr)), ("evaluate", _eval(root / run_id, acc, 0.046))):
            lineage.record_artifact(art, step, "stage1", {}, [])
            lineage.record_step(StepRow(run_id, step, "stage1", art.fingerprint, "completed", {}, "v", now, now))
        lineage.end_run(run_id, "completed")
    return root, lineage


def test_config_differences_are_named_by_override_path():
    a = load_recipe("tiny").model_dump(mode="json")
    b = load_recipe("tiny", ["training.optimizer.lr=0.001", "stages.long2.tokens=65536"]).model_dump(mode="json")
    assert config_differences(a, b) == [("stages.long2.tokens", 49152, 65536), ("training.optimizer.lr", 0.003, 0.001)]
    assert config_differences(a, a) == []


def test_each_eval_difference_comes_with_its_noise():
    a = [{"model": "s1", "task": "t", "metric": "acc", "score": 0.30, "stderr": 0.03, "items": 100}]
    b = [{**a[0], "score": 0.40}, {**a[0], "task": "only_b"}]
    pairs = eval_pairs(a, b)
    assert pairs[0]["diff"] == pytest.approx(0.10) and pairs[0]["se"] == pytest.approx(math.hypot(0.03, 0.03))
    assert pairs[0]["signal"] is True  # 0.10 > 2 x 0.0424
    assert "diff" not in pairs[1]  # only in one run: no difference to speak of
    assert eval_pairs(a, [{**a[0], "score": 0.35}])[0]["signal"] is False  # 0.05: noise


def test_a_think_mode_score_is_shown_with_its_think_length_and_closed_share():
    """Both modes are rows of `eval_rows` (arithmetic_exact, arithmetic_exact_think): compare
    pairs them per task like any other, the think-mode one with its think statistics."""
    row = {"model": "sft", "task": "arithmetic_exact_think", "metric": "exact_match", "score": 0.3}
    think = {**row, "stderr": 0.065, "items": 50, "think_tokens": 41.5, "think_closed": 0.9}
    assert _score(think) == "0.300±0.065 (n=50, think 41.5 tok, 90% closed)"
    assert _score({**row, "stderr": None, "items": 50}) == "0.300 (n=50)"
    assert eval_pairs([think], [{**think, "score": 0.1}])[0]["diff"] == pytest.approx(-0.2)


@pytest.mark.slow
def test_smollm3_compare_prints_differences_curves_and_evals_and_publishes_them(two_runs, capsys, prefect_harness):
    from prefect.artifacts import Artifact as PrefectArtifact

    root, lineage = two_runs
    result = compare_runs(lineage, "aaaa", "bbbb", root / "reports" / "cmp.md")
    assert result["plot"].read_bytes().startswith(b"\x89PNG") and result["report"].is_file()
    text = result["text"]
    assert "training.optimizer.lr: 0.001 -> 0.003" in text and "sources.math.max_documents: 3000 -> 999" in text
    assert "workspace" not in text.split("== config differences")[1].split("==")[0]  # where, not what
    (prose,) = [line for line in text.splitlines() if "stage1 prose_cloze" in line]
    assert "A 0.300±0.046 (n=100)" in prose and "B 0.520±0.046 (n=100)" in prose
    assert "B-A +0.220±0.065" in prose and "beyond noise" in prose
    (arith,) = [line for line in text.splitlines() if "stage1 arithmetic_cloze" in line]
    assert "within noise" in arith
    section = text.split("== final training loss per stage (A, B) ==")[1].split("==")[0]
    (final,) = [line.split() for line in section.splitlines() if line.strip().startswith("stage1 ")]
    assert len(final) == 3 and final[1] != final[2]  # the stage's final loss in A and in B

    assert main(["compare", "aaaa", "bbbb", "--workspace", str(root / "ws")]) == 0
    out = capsys.readouterr().out
    assert "== evals side by side" in out and "Prefect artifact: compare-aaaa1111-bbbb2222" in out
    art = PrefectArtifact.get("compare-aaaa1111-bbbb2222")
    assert "| `training.optimizer.lr` | `0.001` | `0.003` |" in art.data
    assert "data:image/png;base64," in art.data and "beyond noise" in art.data
    assert (root / "ws" / "reports" / "compare-aaaa1111-bbbb2222-loss.png").is_file()
