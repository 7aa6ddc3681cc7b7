"""The smollm3 command line: lineage trees, run listings, recipe validation and exit codes."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from flows.cli import main
from pipeline.artifact import run_step
from pipeline.lineage import Lineage, StepRow


@pytest.fixture
def workspace(tmp_path):
    """A workspace with source -> tokenizer -> shards recorded through the real step contract."""
    lin = Lineage(tmp_path / "lineage.duckdb")

    def make(step, label, inputs, meta):
        out = run_step(
            root=tmp_path,
            step=step,
            version=1,
            kind={"source": "corpus", "tokenizer": "tokenizer", "tokenize": "shards"}[step],
            config={"label": label},
            inputs=inputs,
            build=lambda _: meta,
        ).artifact
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
    # prose is reached twice (directly and below the tokenizer): listed once, the second edge counted
    assert text.count(f"corpus {arts['prose'].short}") == 1
    assert out[-1] == "(1 more edge(s) to artifacts listed above; `smollm3 lineage --full` prints them)"
    assert main(["lineage", arts["shards"].short, "--full", "--workspace", str(root)]) == 0
    full = capsys.readouterr().out
    assert full.count(f"corpus {arts['prose'].short}") == 2 and f"corpus {arts['prose'].short}  (above)" in full
    assert "more edge(s)" not in full


def test_lineage_by_path_and_descendants(workspace, capsys):
    root, arts = workspace
    assert main(["lineage", str(arts["math"].path / "_COMPLETE.json"), "--descendants", "--workspace", str(root)]) == 0
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


def test_a_bad_query_is_a_clean_error_naming_the_tables(workspace, capsys):
    root, _ = workspace
    assert main(["sql", "SELECT * FROM nosuch", "--workspace", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("smollm3 sql: error: CatalogException:") and "nosuch" in err
    assert "Traceback" not in err and "steps" in err.splitlines()[-1]  # the tables there are
    assert main(["sql", "SELECT count(*) AS n FROM steps", "--workspace", str(root)]) == 0
    out = capsys.readouterr()
    assert "2" in out.out and out.err == ""  # a read says nothing more


def test_a_write_says_it_went_to_a_discarded_copy(workspace, capsys):
    root, _ = workspace
    assert main(["sql", "DELETE FROM steps", "--workspace", str(root)]) == 0
    err = capsys.readouterr().err
    assert "DELETE ran on a private copy of the lineage, which is discarded" in err
    assert main(["sql", "SELECT count(*) AS n FROM steps", "--workspace", str(root)]) == 0
    assert "2" in capsys.readouterr().out  # the lineage still holds both rows


def test_recipe_prints_the_resolved_recipe(capsys):
    assert main(["recipe", "tiny", "seed=5"]) == 0
    assert "seed: 5" in capsys.readouterr().out


def test_demo_with_an_unknown_recipe_stops_before_starting_anything(tmp_path, capsys):
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as err:
        main(["demo", "--recipe", "huge", "--state", str(state), "--workspace", str(tmp_path / "ws")])
    assert "no recipe 'huge'" in str(err.value) and "tiny-learn" in str(err.value)
    assert not state.exists() and not (tmp_path / "ws").exists()  # no server, no serve process, no run


def test_demo_hands_a_valid_recipe_to_the_served_run(tmp_path, monkeypatch):
    """The quiet side of the check above: a shipped recipe by name passes as it is, a recipe file
    as its absolute path (the serve process resolves it from its own folder)."""
    import flows.demo

    got = []
    monkeypatch.setattr(flows.demo, "up", lambda workspace, port, state, recipe: got.append(recipe) or 0)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("base: tiny\noverrides: [seed=3]\n")
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--recipe", "tiny-learn"]) == 0 and main(["demo", "--recipe", "mine.yaml"]) == 0
    assert got == ["tiny-learn", str(recipe.resolve())]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("run", "recipe", "lineage", "runs", "summary", "serve", "demo", "down", "watch", "compare"):
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


# --- lineage --trained-on -----------------------------------------------------------------------


@pytest.fixture
def trained(tmp_path):
    """Two runs' worth of lineage, recorded through the real step contract:

    source prose, math (run 1), math (run 2, other data) -> curate (each decontaminated
    against the raw corpora of the other sources of its run) -> tokenizer (trained on every curated corpus)
    -> tokenize per source -> mixtures -> pretrain stage1 (prose only) -> stage2 (init
    stage1; math of run 1) ; stage3 (math of run 2) ; pin of stage1 at step 4 -> anneal.
    """
    import json

    lin = Lineage(tmp_path / "lineage.duckdb")
    kinds = {
        "source": "corpus",
        "curate": "corpus",
        "tokenizer": "tokenizer",
        "tokenize": "shards",
        "mixture": "mixture",
        "pretrain": "checkpoint",
        "pin": "checkpoint",
    }

    def make(step, label, inputs, meta, config=None, build=None):
        config = config or {"label": label}
        out = run_step(
            root=tmp_path,
            step=step,
            version=1,
            kind=kinds[step],
            config=config,
            inputs=inputs,
            build=build or (lambda _: meta),
        ).artifact
        lin.record_artifact(out, step, label, config, inputs)
        return out

    raw = {
        "prose": make("source", "prose", [], {"source": "prose"}),
        "math": make("source", "math", [], {"source": "math"}),
        "math2": make("source", "math", [], {"source": "math"}, config={"label": "math", "v": 2}),
    }
    runs = {"prose": ("math", "math2"), "math": ("prose",), "math2": ("prose",)}  # each run's other sources
    clean = {
        k: make(
            "curate", v.meta["source"], [v, *(raw[o] for o in runs[k])], {"source": v.meta["source"]}, config={"of": k}
        )
        for k, v in raw.items()
    }
    tok = make("tokenizer", "bpe", list(clean.values()), {"vocab_size": 512})
    shards = {
        k: make("tokenize", c.meta["source"], [tok, c], {"source": c.meta["source"]}, config={"of": k})
        for k, c in clean.items()
    }
    mix1 = make("mixture", "stage1", [shards["prose"], shards["math"]], {})
    stage1 = make("pretrain", "stage1", [mix1], {"tokens_per_source": {"prose": 100, "math": 0}})
    mix2 = make("mixture", "stage2", [shards["prose"], shards["math"]], {})
    stage2 = make("pretrain", "stage2", [mix2, stage1], {"tokens_per_source": {"prose": 0, "math": 50}})
    mix3 = make("mixture", "stage3", [shards["prose"], shards["math2"]], {})
    stage3 = make("pretrain", "stage3", [mix3], {"tokens_per_source": {"math": 70}})

    def pin_build(out):
        ckpt = out / "checkpoint" / "step_00000004"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"tokens_per_source": {"prose": 40, "math": 0}}))
        return {"checkpoint": str(ckpt), "source": str(stage1.path / "checkpoints" / "step_00000004")}

    pin = make("pin", "stage1-4", [], {}, build=pin_build)
    mix4 = make("mixture", "anneal-x", [shards["prose"]], {})
    anneal = make("pretrain", "anneal-x", [mix4, pin], {"tokens_per_source": {"prose": 30}})
    lin.start_run("run-1", "smollm3", "full", "tiny", {})
    now = datetime.now()
    for a, label in [(stage1, "stage1"), (stage2, "stage2")]:
        lin.record_step(StepRow("run-1", "pretrain", label, a.fingerprint, "completed", {}, "v", now, now))
    lin.end_run("run-1", "completed")
    return tmp_path, {
        "raw": raw,
        "shards": shards,
        "stage1": stage1,
        "stage2": stage2,
        "stage3": stage3,
        "anneal": anneal,
        "pin": pin,
    }


def _trained(root, source):
    from flows.views import _pinned_tokens

    lin = Lineage(root / "lineage.duckdb")
    return {
        r.label: (r.stage_tokens, r.cumulative_tokens, r.complete)
        for r in lin.trained_on(source, pinned_tokens=_pinned_tokens)
    }


def test_trained_on_counts_what_each_stage_drew_not_descent_through_the_tokenizer(trained):
    root, a = trained
    # every stage descends from every source (tokenizer, decontamination), but:
    assert _trained(root, "prose") == {
        "stage1": (100, 100, True),
        "stage2": (0, 100, True),
        "anneal-x": (30, 70, True),
    }  # 40 drawn by stage1 at the pin
    assert _trained(root, "math") == {"stage2": (50, 50, True), "stage3": (70, 70, True)}
    # one source artifact: only stages whose mixture read the shards made from it
    assert _trained(root, a["raw"]["math"].short) == {"stage2": (50, 50, True)}
    assert _trained(root, a["raw"]["math2"].fingerprint) == {"stage3": (70, 70, True)}
    assert _trained(root, a["shards"]["math2"].short) == {"stage3": (70, 70, True)}
    (row,) = [r for r in Lineage(root / "lineage.duckdb").trained_on("prose") if r.label == "stage2"]
    assert [(label, tokens) for label, _, tokens in row.chain] == [("stage1", 100), ("stage2", 0)]
    assert row.runs == ("run-1",) and row.shards == (a["shards"]["prose"].fingerprint,)


def test_the_trainer_state_file_name_is_the_trainers():
    from flows.views import TRAINER_STATE
    from model.checkpoint import TRAINER_STATE as TRAINERS

    assert TRAINER_STATE == TRAINERS


def test_trained_on_through_an_unreadable_pin_is_a_lower_bound(trained):
    root, a = trained
    (a["pin"].path / "checkpoint" / "step_00000004" / "trainer_state.json").unlink()
    assert _trained(root, "prose")["anneal-x"] == (30, 30, False)


def test_cli_lineage_trained_on(trained, capsys):
    root, a = trained
    assert main(["lineage", "--trained-on", "math", "--workspace", str(root)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints trained on source 'math'" in out
    assert f"pretrain[stage2]      {a['stage2'].short}" in out and a["stage3"].short in out
    assert a["stage1"].short not in out.split("chain")[0]  # stage1 drew no math
    # a folder of the source's shards names the source artifact
    assert main(["lineage", "--trained-on", str(a["shards"]["math2"].path), "--workspace", str(root)]) == 0
    out = capsys.readouterr().out
    assert a["stage3"].short in out and a["stage2"].short not in out
    assert main(["lineage", "--trained-on", "poetry", "--workspace", str(root)]) == 2
    assert "sources with shards: math, prose" in capsys.readouterr().err
    assert main(["lineage", "--trained-on", a["stage1"].short, "--workspace", str(root)]) == 2
    assert "not a source, curated corpus or token shards" in capsys.readouterr().err
    assert main(["lineage", "--workspace", str(root)]) == 2
    assert "--trained-on SOURCE" in capsys.readouterr().err


# --- a self-explaining command line -------------------------------------------------------------


def test_every_subcommand_help_names_itself_and_explains_its_arguments(capsys):
    import argparse

    from flows.cli import PASS_THROUGH, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        if name in PASS_THROUGH:
            continue
        assert p.prog == f"smollm3 {name}"
        for action in p._actions:
            assert action.help, f"smollm3 {name}: {action.dest} has no help"
    for name in PASS_THROUGH:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert out.startswith(f"usage: smollm3 {name}"), out[:80]
        assert "python -m" not in out and "infra." not in out and "tasks." not in out


def test_unknown_refresh_names_are_refused_with_the_steps(capsys):
    assert main(["plan", "tiny", "--refresh", "preflight,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown step(s) bogus; steps of flow 'smollm3':" in err and "pretrain" in err
    assert main(["run", "tiny", "--refresh", "tokeniser"]) == 2
    assert "unknown step(s) tokeniser" in capsys.readouterr().err
    assert main(["plan", "tiny", "--flow", "cpt", "--refresh", "curate"]) == 2
    assert "steps of flow 'cpt'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        (["--help"], ("prefect", "torch", "datatrove", "transformers", "duckdb")),
        (["runs"], ("prefect", "torch", "datatrove", "transformers")),
        (["lineage", "--trained-on", "prose"], ("prefect", "torch", "datatrove", "transformers")),
        (["recipe", "tiny"], ("prefect", "torch", "datatrove", "transformers", "lm_eval", "duckdb")),
        (["plan", "tiny"], ("torch", "datatrove", "transformers", "lm_eval", "trl")),
    ],
)
@pytest.mark.slow
def test_light_commands_do_not_import_heavy_libraries(argv, absent, tmp_path):
    """What makes them answer in about a second (benchmarks/cli_latency.py has the times)."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\nfrom flows.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if '.' not in m)))"
    )
    env = {**os.environ, "SMOLLM3_HOME": str(tmp_path)}
    # recipe and plan curate a sample of each readable source once (datatrove, seconds) and keep
    # the result in the workspace (flows/datacheck.py): a repeat is light
    for _ in range(2 if argv[0] in ("recipe", "plan") else 1):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
            timeout=300,
        )
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not loaded & set(absent), f"smollm3 {' '.join(argv)} imported {sorted(loaded & set(absent))}"


def test_the_sql_in_the_docs_gives_the_per_stage_answer(trained):
    """docs/architecture.md shows the query for "which checkpoints trained on prose": it must agree
    with `Lineage.trained_on` on the stages that drew tokens themselves."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = doc[doc.index("### Which checkpoints trained on a source") :]
    sql = re.search(r"```sql\n(.*?)```", section, re.S).group(1)
    root, _ = trained
    lin = Lineage(root / "lineage.duckdb")
    rows = lin.snapshot_query(sql)
    expected = [(r.label, r.checkpoint.fingerprint, r.stage_tokens) for r in lin.trained_on("prose") if r.stage_tokens]
    assert [(r["stage"], r["checkpoint"], r["tokens"]) for r in rows] == expected
    assert [label for label, *_ in expected] == ["stage1", "anneal-x"]


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

    model = run_step(
        root=tmp_path, step="export", version=1, kind="hf_model", config={"label": "stage1"}, inputs=[], build=export
    ).artifact
    scores = {"prose_cloze": {"acc": 0.3, "acc_stderr": 0.05, "acc_norm": 0.32, "acc_norm_stderr": 0.047}}
    ev = run_step(
        root=tmp_path,
        step="evaluate",
        version=1,
        kind="eval",
        config={"label": "stage1"},
        inputs=[model],
        build=lambda _: {
            "stage": "stage1",
            "scores": scores,
            "items": {"prose_cloze": 100},
            "random_baseline": {"prose_cloze": 0.25},
            "random_accuracy": 0.25,
        },
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
    capsys.readouterr()
    assert main(["report", "run-2", "--workspace", str(root), "--out", str(report)]) == 0
    text = report.read_text()
    assert re.search(r"Final model: `(\S+)`", text).group(1) == path
    assert "| stage1 | 0.320±0.047 |" in text
    # the command prints a short summary, not only the report's path
    assert capsys.readouterr().out.splitlines() == [
        "run run-2: recipe tiny, completed",
        "final training loss: none recorded in this run",
        "best eval over random: prose_cloze acc_norm 0.320 ± 0.047 (random 0.250) by stage1",
        f"final model: {path} (AutoModelForCausalLM.from_pretrained loads it)",
        f"report: {report}",
    ]


def test_report_of_a_run_whose_stage_folder_is_gone_says_so(model_run, tmp_path):
    import shutil

    root, model = model_run
    lin = Lineage(root / "lineage.duckdb")
    stage = run_step(
        root=root,
        step="pretrain",
        version=1,
        kind="checkpoint",
        config={"label": "stage1"},
        inputs=[],
        build=lambda _: {"stage": "stage1"},
    ).artifact
    lin.record_artifact(stage, "pretrain", "stage1", {"label": "stage1"}, [])
    now = datetime.now()
    lin.record_step(StepRow("run-2", "pretrain", "stage1", stage.fingerprint, "completed", {}, "v", now, now))
    shutil.rmtree(stage.path)
    out = tmp_path / "r.md"
    assert main(["report", "run-2", "--workspace", str(root), "--out", str(out)]) == 0
    assert "(no loss curve: a stage folder of this run is not readable here:" in out.read_text()
