"""flows/views.py: the eval table a run's summary prints carries the run report's check of each
post-training step against the model it started from, read from lineage."""

from __future__ import annotations

from datetime import UTC, datetime

from flows.views import eval_table
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
