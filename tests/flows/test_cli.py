"""The smollm3 command line: lineage trees, run listings, recipe validation and exit codes."""

from __future__ import annotations

from datetime import datetime

import pytest

from flows.cli import main
from infra.artifact import run_step
from infra.lineage import Lineage, StepRow


@pytest.fixture
def workspace(tmp_path):
    """A workspace with source -> tokenizer -> shards recorded through the real step contract."""
    lin = Lineage(tmp_path / "lineage.duckdb")

    def make(step, label, inputs, meta):
        out = run_step(root=tmp_path, step=step, version=1, kind={"source": "corpus", "tokenizer": "tokenizer", "tokenize": "shards"}[step],
                       config={"label": label}, inputs=inputs, build=lambda _: meta).artifact
        lin.record_artifact(out, step, label, {"label": label}, inputs)
        return out

    prose = make("source", "prose", [], {"documents": 10})
    math = make("source", "math", [], {"documents": 20})
    tok = make("tokenizer", "bpe", [prose, math], {"vocab_size": 512})
    shards = make("tokenize", "prose", [tok, prose], {"tokens": 999})
    lin.start_run("run-1", "smollm3", "full", "tiny", {})
    now = datetime.now()
    for a, step, label in [(prose, "source", "prose"), (shards, "tokenize", "prose")]:
        lin.record_step(StepRow("run-1", step, label, a.fingerprint, "cached", {}, "v", now, now))
    lin.end_run("run-1", "completed")
    return tmp_path, {"prose": prose, "math": math, "tok": tok, "shards": shards}


def test_lineage_prints_the_ancestor_tree(workspace, capsys):
    root, arts = workspace
    assert main(["lineage", arts["shards"].short, "--workspace", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"shards {arts['shards'].short}  tokenize[prose]") and "tokens=999" in out[0]
    text = "\n".join(out)
    for name in ("tok", "prose", "math"):
        assert arts[name].short in text
    # prose appears twice: directly and below the tokenizer
    assert text.count(f"corpus {arts['prose'].short}") == 2


def test_lineage_by_path_and_descendants(workspace, capsys):
    root, arts = workspace
    assert main(["lineage", str(arts["math"].path / "_COMPLETE.json"), "--descendants",
                 "--workspace", str(root)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"corpus {arts['math'].short}")
    assert arts["tok"].short in text and arts["shards"].short in text
    assert arts["prose"].short not in text


def test_runs_lists_steps_and_states(workspace, capsys):
    root, arts = workspace
    assert main(["runs", "--workspace", str(root)]) == 0
    out = capsys.readouterr().out
    assert "run-1  smollm3/full  recipe=tiny  completed" in out
    assert "tokenize[prose]" in out and "cached" in out


def test_errors_exit_2_and_name_the_problem(workspace, capsys):
    root, _ = workspace
    assert main(["lineage", "ffffffffffff", "--workspace", str(root)]) == 2
    assert "no artifact with fingerprint 'ffffffffffff'" in capsys.readouterr().err
    assert main(["recipe", "tiny", "sources.math.domain=algebra"]) == 2
    assert "sources[math].domain" in capsys.readouterr().err


def test_recipe_prints_the_resolved_recipe(capsys):
    assert main(["recipe", "tiny", "seed=5"]) == 0
    assert "seed: 5" in capsys.readouterr().out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("run", "recipe", "lineage", "runs", "summary", "serve", "demo", "down"):
        assert cmd in out


def test_report_writes_the_run_to_a_file(workspace, tmp_path, capsys):
    root, _ = workspace
    out = tmp_path / "r" / "report.md"
    assert main(["report", "run-1", "--workspace", str(root), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# smollm3 run run-1") and "tokenize[prose]" in text
    assert "## Eval scores per stage" in text
    assert main(["report", "nope", "--workspace", str(root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
