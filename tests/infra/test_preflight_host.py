"""The host checks (infra/preflight/host.py): the open-file limit, measured in a process whose limit
was lowered from outside (as a node's limits.conf or a job's `ulimit` would), and the host memory
against a node's need."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from infra.preflight import PreflightConfig, PreflightFacts, run_preflight

REPO = Path(__file__).resolve().parents[2]


def _open_files_row(tmp_path: Path, limit: int | None, need: int) -> dict:
    """The open_files row of `python -m infra.preflight` run with RLIMIT_NOFILE set to `limit`
    (soft and hard) before it starts."""

    def lower() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    out = tmp_path / f"report-{limit}-{need}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.preflight",
            "checks=[open_files]",
            f"facts.open_files={need}",
            "--json",
            str(out),
        ],
        cwd=REPO,
        preexec_fn=lower,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.read_text())
    assert report["node"]  # named (the host name by default)
    (row,) = report["results"]
    return row | {"rc": proc.returncode}


def test_a_hard_limit_below_what_a_rank_opens_fails(tmp_path):
    row = _open_files_row(tmp_path, 512, 4096)
    assert row["status"] == "fail" and row["rc"] == 1
    assert row["value"] == "soft 512, hard 512" and "ulimit -n 4096" in row["advice"]


def test_a_limit_the_job_can_raise_passes(tmp_path):
    row = _open_files_row(tmp_path, None, 256)  # this process's limits: the soft one raised if need be
    assert row["status"] == "pass" and row["rc"] == 0, row
    assert _open_files_row(tmp_path, 1024, 1024)["status"] == "pass"


def test_without_the_need_open_files_and_host_memory_skip_showing_what_they_read():
    results = {
        r.name: r for r in run_preflight(PreflightConfig(checks=("open_files", "host_memory")), PreflightFacts())
    }
    assert results["open_files"].status == "skip" and results["open_files"].advice.startswith("soft ")
    assert results["host_memory"].status == "skip" and "MemAvailable" in results["host_memory"].advice


def test_host_memory_fails_when_the_node_cannot_give_what_the_plan_needs():
    config = PreflightConfig(checks=("host_memory",))
    (small,) = run_preflight(config, PreflightFacts(host_memory_gb=0.1), log=lambda _: None)
    assert small.status == "pass" and small.metric > 0.1
    (huge,) = run_preflight(config, PreflightFacts(host_memory_gb=10**6), log=lambda _: None)
    assert huge.status == "fail" and "of the 1e+06 GB the stage plan needs" in huge.advice
