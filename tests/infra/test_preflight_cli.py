"""`python -m infra.preflight`: listing, overrides, exit codes and the JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

from infra.preflight.cli import main  # noqa: E402


def test_list_names_every_check(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "gpu_matmul" in out and "gloo_allreduce" in out and "batch_layout" in out


def test_bad_input_exits_2_naming_the_field(capsys):
    assert main(["bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["facts.world=8"]) == 2
    assert "unknown field(s) world" in capsys.readouterr().err


def test_exit_code_follows_the_stop_rule(tmp_path, capsys):
    facts = tmp_path / "facts.yaml"
    facts.write_text("nproc_per_node: 2\nglobal_batch: 8\nmicro_batch: 2\nseq_len: 64\nmax_positions: 32\n")
    report = tmp_path / "pf.json"
    rc = main(["--facts", str(facts), "checks=[batch_layout,seq_len]", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 1 and "STOP" in out and "seq_len" in out
    data = json.loads(report.read_text())
    assert data["stop"] and [r["status"] for r in data["results"]] == ["pass", "fail"]
    assert main(["--facts", str(facts), "checks=[batch_layout]"]) == 0


def test_smollm3_preflight_measures_the_workspace_every_command_uses(tmp_path):
    """Run from another directory: the relative workspace is $SMOLLM3_HOME's, as for `run` and
    `plan`; nothing is created in the current directory; a failing disk names real fields."""
    import os
    import subprocess

    cwd, home = tmp_path / "elsewhere", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMOLLM3_HOME": str(home)}
    checks = "preflight.checks=[disk_free,checkpoint_io]"
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "preflight", "tiny", checks, "preflight.io_probe_mib=1"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"free at {home / 'workspace' / 'checkpoints'}" in out.stdout
    assert list(cwd.iterdir()) == []  # no ./workspace/checkpoints here
    full = subprocess.run(
        [sys.executable, "-m", "flows.cli", "preflight", "tiny", checks, "preflight.disk_headroom=1e12"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert full.returncode == 1 and "disk_free      FAIL" in full.stdout
    assert "lower training.keep_last" in full.stdout and "preflight.checkpoint_dir" in full.stdout
    assert "lower checkpoint_keep" not in full.stdout
