"""The smollm3 command line: lineage trees, run listings, recipe validation and exit codes."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

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
    assert "## Eval scores" in text
    assert main(["report", "nope", "--workspace", str(root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


@pytest.fixture
def model_run(tmp_path):
    """A run that exported a model (as the export step writes it: `model/` in its step folder)
    and evaluated it, recorded through the real step contract."""
    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    lin = Lineage(tmp_path / "lineage.duckdb")

    def export(out):
        model = SmolLM3(ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2))
        model.init_weights(seed=0)
        return {"stage": "stage1", "model_dir": str(export_hf(model, out / "model"))}

    model = run_step(root=tmp_path, step="export", version=1, kind="hf_model", config={"label": "stage1"},
                     inputs=[], build=export).artifact
    scores = {"prose_cloze": {"acc": 0.3, "acc_stderr": 0.05, "acc_norm": 0.32, "acc_norm_stderr": 0.047}}
    ev = run_step(root=tmp_path, step="evaluate", version=1, kind="eval", config={"label": "stage1"},
                  inputs=[model], build=lambda _: {"stage": "stage1", "scores": scores, "items": {"prose_cloze": 100},
                                                   "random_baseline": {"prose_cloze": 0.25}, "random_accuracy": 0.25}
                  ).artifact
    lin.start_run("run-2", "smollm3", "full", "tiny", {})
    now = datetime.now()
    for art, step in [(model, "export"), (ev, "evaluate")]:
        lin.record_artifact(art, step, "stage1", {"label": "stage1"}, [model] if art is ev else [])
        lin.record_step(StepRow("run-2", step, "stage1", art.fingerprint, "completed", {}, "v", now, now))
    lin.end_run("run-2", "completed")
    return tmp_path, model


def _loads(path: str) -> bool:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path) is not None


def test_every_printed_model_path_loads_with_from_pretrained(model_run, tmp_path, capsys):
    """lineage, summary and report show a model at the folder `from_pretrained` loads (the
    export's `model/`), never its step folder."""
    import re

    root, model = model_run
    assert main(["lineage", model.short, "--workspace", str(root)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    path = re.match(rf"hf_model {model.short}  export\[stage1\]  (\S+)", line).group(1)
    assert path == model.meta["model_dir"] and Path(path).name == "model" and _loads(path)

    assert main(["summary", "--workspace", str(root), "--ui", "http://ui"]) == 0
    out = capsys.readouterr().out
    final = re.search(r"^final model:  (\S+)  \(AutoModelForCausalLM", out, re.M).group(1)
    assert final == path and _loads(final)
    assert "prose_cloze" in out and "acc_norm" in out and "0.320±0.047" in out  # the eval table

    report = tmp_path / "r.md"
    assert main(["report", "run-2", "--workspace", str(root), "--out", str(report)]) == 0
    text = report.read_text()
    assert re.search(r"Final model: `(\S+)`", text).group(1) == path
    assert "| stage1 | 0.320±0.047 |" in text


def test_report_of_a_run_whose_stage_folder_is_gone_says_so(model_run, tmp_path):
    import shutil

    root, model = model_run
    lin = Lineage(root / "lineage.duckdb")
    stage = run_step(root=root, step="pretrain", version=1, kind="checkpoint", config={"label": "stage1"},
                     inputs=[], build=lambda _: {"stage": "stage1"}).artifact
    lin.record_artifact(stage, "pretrain", "stage1", {"label": "stage1"}, [])
    now = datetime.now()
    lin.record_step(StepRow("run-2", "pretrain", "stage1", stage.fingerprint, "completed", {}, "v", now, now))
    shutil.rmtree(stage.path)
    out = tmp_path / "r.md"
    assert main(["report", "run-2", "--workspace", str(root), "--out", str(out)]) == 0
    assert "(no loss curve: a stage folder of this run is not readable here:" in out.read_text()
