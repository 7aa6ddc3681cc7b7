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
