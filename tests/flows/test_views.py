"""flows/views.py: the eval table a run's summary prints carries the run report's check of each
post-training step against the model it started from, read from lineage."""

from __future__ import annotations

from datetime import UTC, datetime

from flows.views import eval_table, rl_rewards, summary
from pipeline.artifact import Artifact
from pipeline.lineage import Lineage
from pipeline.lineage.store import StepRow
from tasks.run_report import RunReportSpec


def _record(lineage: Lineage, run_id: str, step: str, label: str, art: Artifact, config) -> None:
    now = datetime.now(UTC)
    lineage.record_artifact(art, step, label, config)
    lineage.record_step(StepRow(run_id, step, label, art.fingerprint, "completed", config, "c", now, now))


def test_the_summary_table_flags_steps_once_the_run_has_its_report(tmp_path):
    lineage = Lineage(tmp_path / "lineage.duckdb")
    lineage.start_run("run-1", "smollm3", None, "tiny", {})
    for i, (label, exact, stderr) in enumerate((("base", 0.0, 0.0), ("sft", 0.3, 0.065), ("apo", 0.32, 0.066))):
        scores = {"arithmetic_exact": {"exact_match": exact, "exact_match_stderr": stderr}}
        meta = {"scores": scores, "items": {"arithmetic_exact": 50}, "random_baseline": {"arithmetic_exact": 0.0}}
        art = Artifact(kind="eval", uri=str(tmp_path / label), fingerprint=str(i) * 64, meta=meta)
        _record(lineage, "run-1", "evaluate", label, art, {"label": label})
    assert "vs" not in eval_table(lineage, "run-1")  # no report yet: the table alone
    spec = RunReportSpec(evals=("base", "sft", "apo"), parents=(("sft", "base"), ("apo", "sft")))
    report = Artifact(kind="report", uri=str(tmp_path / "report"), fingerprint="r" * 64, meta={})
    _record(lineage, "run-1", "run_report", "smollm3", report, spec)
    table = eval_table(lineage, "run-1")
    assert "sft vs base: arithmetic_exact +0.300 (+4.6 se)" in table
    assert "apo vs sft: NO CHANGE BEYOND NOISE on any task (largest: arithmetic_exact +0.020, +0.2 se)" in table
    assert "- apo vs sft: NO CHANGE BEYOND NOISE" in eval_table(lineage, "run-1", markdown=True)


def test_the_summary_says_whether_each_rl_steps_reward_rose(tmp_path):
    """The RL steps' reward trend, from their meta as the trainers write it (reward_trend): a
    flat GRPO run, a rising SAO run, a run too short for a trend (4 updates: shares of 2 have no
    stderr) and one built before the trend was kept, each said as such."""
    from trainers.posttrain.common import reward_trend

    lineage = Lineage(tmp_path / "lineage.duckdb")
    lineage.start_run("run-1", "smollm3", None, "tiny", {})
    assert rl_rewards(lineage, "run-1") == ""  # no RL step: no section
    flat, _ = reward_trend([0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2])
    rose, _ = reward_trend([0.0, 0.1, 0.05, 0.0, 0.1, 0.05, 0.5, 0.6, 0.55, 0.5, 0.6, 0.55])
    short, _ = reward_trend([0.45, 0.45, 0.2, 0.2])
    metas = {
        ("grpo", "grpo"): {"steps": 12, **{f"exact_{k}": v for k, v in flat.items()}},
        ("sao", "sao"): {"steps": 12, **rose},
        ("grpo", "grpo-short"): {"steps": 4, **{f"exact_{k}": v for k, v in short.items()}},
        ("sao", "sao-old"): {"steps": 3},
    }
    for i, ((step, label), meta) in enumerate(metas.items()):
        art = Artifact(kind="hf_model", uri=str(tmp_path / label), fingerprint=str(i) * 64, meta=meta)
        _record(lineage, "run-1", step, label, art, {"label": label})
    lines = rl_rewards(lineage, "run-1").splitlines()
    assert lines == [
        "grpo: exact-match reward over 12 updates, by quarter: 0.133 ± 0.033, 0.167 ± 0.033, 0.133 ± 0.033, "
        "0.167 ± 0.033: NO RISE beyond 2 stderr",
        "grpo[grpo-short]: exact-match reward over 4 updates: too few for a trend",
        "sao: reward over 12 updates, by quarter: 0.050 ± 0.029, 0.050 ± 0.029, 0.550 ± 0.029, 0.550 ± 0.029: "
        "ROSE beyond 2 stderr",
        "sao[sao-old]: reward over 3 updates: not recorded (built before the trend was kept)",
    ], lines
    table = rl_rewards(lineage, "run-1", markdown=True)
    assert table.splitlines()[0] == "| step | reward | updates | mean ± stderr | verdict |"
    assert "| sao | reward | 12 | by quarter: 0.050 ± 0.029" in table
    # the demo's summary carries the section
    assert "== RL reward ==\ngrpo: exact-match reward over 12 updates" in summary(lineage, None)
