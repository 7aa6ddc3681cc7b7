"""A preflight's report files, the error that stops training (warnings stop unless allowed) and
the summary a passing run hands on, with a GPU backend double standing in for two GPUs."""

from __future__ import annotations

import json

from infra.preflight import PreflightConfig, PreflightFacts, run_preflight
from infra.preflight.outcome import REPORT_JSON, REPORT_MD, step_summary, stop_error, write_report


class TwoGpus:
    def unavailable_reason(self):
        return None

    def device_count(self):
        return 2

    def name(self, index):
        return "fake"


def _run(cfg: PreflightConfig, out):
    results = run_preflight(cfg, PreflightFacts(), gpu=TwoGpus(), log=lambda _: None)
    logged = []
    report = write_report(out, "run-7", cfg, PreflightFacts(), results, calibration=[{"x": 1}], log=logged.append)
    return results, report, logged


def test_a_warning_stops_unless_allowed_and_the_report_says_so(tmp_path):
    cfg = PreflightConfig(checks=("gpu_count",), expected_gpus=1)
    results, report, logged = _run(cfg, tmp_path)
    assert report["stop"] and report["summary"]["warn"] == 1
    on_disk = json.loads((tmp_path / REPORT_JSON).read_text())
    assert on_disk == report and on_disk["calibration"] == [{"x": 1}] and on_disk["run_id"] == "run-7"
    assert "(STOP)" in (tmp_path / REPORT_MD).read_text() and "gpu_count" in logged[0]
    err = stop_error(results, cfg, tmp_path)
    assert "1 blocking check(s) of 1" in str(err) and "gpu_count: WARN" in str(err)
    assert "allow_warn=true" in str(err) and str(tmp_path / REPORT_MD) in str(err)

    allowed = PreflightConfig(checks=("gpu_count",), expected_gpus=1, allow_warn=True)
    results, report, _ = _run(allowed, tmp_path)
    assert not report["stop"] and "(go)" in (tmp_path / REPORT_MD).read_text()
    meta = step_summary(report, results)
    assert meta["warned"] == ["gpu_count"] and meta["allow_warn"] and meta["run_id"] == "run-7"
    assert meta["calibration"] == [{"x": 1}] and meta["gpu_tflops"] is None


def test_a_failure_gives_no_allow_warn_hint(tmp_path):
    cfg = PreflightConfig(checks=("batch_layout",))
    facts = PreflightFacts(nproc_per_node=2, global_batch=7, micro_batch=2)
    results = run_preflight(cfg, facts, log=lambda _: None)
    assert write_report(tmp_path, "r", cfg, facts, results, log=lambda _: None)["stop"]
    err = stop_error(results, cfg, tmp_path)
    assert "batch_layout: FAIL" in str(err) and "allow_warn" not in str(err)
    assert err.results == results
