"""The ablation flow through Prefect on the tiny recipe at test size: a baseline and one variant
(a 10x lower learning rate), two seeds each, on a 2-layer 64-wide model trained 8 steps with a
checkpoint kept every 2.

Checked: the data steps the variant shares with the baseline run once (in a copy of the session's
finished data steps, tests/conftest.py `built_workspace`, so they reuse their folders); the four runs train
side by side in two train slots; held-out bits per byte is measured at every kept checkpoint and
lm-eval after the stage; the comparison lands in DuckDB (`experiments`, `experiment_runs`,
`experiment_results`) and in Prefect (table and report artifacts), says which evals it trusts and
why, and `smollm3 experiments` prints it; `smollm3 ablate --plan` then reuses every step.
"""

from __future__ import annotations

import json

import pytest

from pipeline.lineage import Lineage
from tests.conftest import TINY_TRAIN

OVERRIDES = [
    *(o for o in TINY_TRAIN if o.startswith("sources.")),  # every source keeps a held-out split
    "stages=[{name: stage1, mixture: mixtures/tiny/stage1.yaml, tokens: 16384, seq_len: 256}]",
    "training.global_batch=8",
    "training.warmup_steps=2",
    "training.decay_stages=1",
    "training.model_overrides={hidden_size: 64, intermediate_size: 192, num_layers: 2, num_heads: 2, num_kv_heads: 1}",
    "eval.items_per_task=20",
    "eval.batch_size=64",
    "preflight.max_epochs=1000",
    "posttrain=null",
    "resources.train.slots=2",
    "resources.train.threads=1",  # two trainers side by side on 2 cores
]
VARIANT = "lr_low:training.optimizer.lr=0.0003"


@pytest.mark.slow
def test_ablation_shares_data_trains_seeds_side_by_side_and_compares_with_noise(
    workspace_copy, prefect_harness, capsys
):
    from prefect.artifacts import Artifact as PrefectArtifact

    from flows.cli import main
    from flows.prefect_flows import ablation

    # A copy of the session's data part of the tiny DAG at these source sizes (tests/conftest.py):
    # the ablation reuses its sources, curations, tokenizer and shards and builds the rest.
    ws = workspace_copy("tiny-data")
    over = [*OVERRIDES, f"workspace={ws}"]
    result = ablation(variants=[VARIANT], seeds=2, overrides=over, eval_every=2, heldout_tokens=4096, lm_eval="final")
    assert set(result["states"]) == {"completed", "cached"}  # the copy's data steps reused, the rest built
    lineage = Lineage(ws / "lineage.duckdb")
    steps = lineage.steps_of(result["run_id"])
    count = {}
    for s in steps:
        count[s["step"]] = count.get(s["step"], 0) + 1
    # Shared data once: 3 sources, curations, shard sets and held-out sets; one tokenizer, suite,
    # preflight. Per run (2 variants x 2 seeds): a stage, its held-out eval, export and lm-eval;
    # seed 1 draws its own data order (one more mixture plan, shared by both variants).
    assert {k: count[k] for k in ("source", "curate", "tokenize", "heldout_tokens")} == dict.fromkeys(
        ("source", "curate", "tokenize", "heldout_tokens"), 3
    )
    assert count["tokenizer"] == count["eval_suite"] == count["preflight"] == count["compare"] == 1
    assert count["mixture"] == 2
    assert count["pretrain"] == count["heldout_eval"] == count["export"] == count["evaluate"] == 4
    spans = [(s["started"], s["ended"]) for s in steps if s["step"] == "pretrain"]
    assert any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a != b), spans  # side by side

    # Every kept checkpoint (steps 2, 4, 6, 8) scored on each source's held-out bits per byte.
    for row in lineage.query_dicts("SELECT label, meta FROM artifacts WHERE step = 'heldout_eval'"):
        points = json.loads(row["meta"])["points"]
        assert [p["global_step"] for p in points] == [2, 4, 6, 8], row["label"]
        assert set(points[0]["scores"]) == {"heldout_prose", "heldout_code", "heldout_math"}
    specs = {
        r["label"]: json.loads(r["config"])["spec"]
        for r in lineage.query_dicts("SELECT label, config FROM artifacts WHERE step = 'pretrain'")
    }
    assert {k: (v["seed"], v["optimizer"]["lr"]) for k, v in specs.items()} == {
        "baseline-s0-stage1": (0, 0.003),
        "baseline-s1-stage1": (1, 0.003),
        "lr_low-s0-stage1": (0, 0.0003),
        "lr_low-s1-stage1": (1, 0.0003),
    }

    # The experiment in DuckDB: runs, the trusted evals and the comparison with seed noise.
    (exp,) = lineage.experiments("ablation")
    assert exp["experiment"] == result["experiment"] and exp["run_id"] == result["run_id"]
    assert json.loads(exp["seeds"]) == {"baseline": 2, "lr_low": 2}
    quality = json.loads(exp["quality"])
    trusted = json.loads(exp["trusted"])
    assert trusted == sorted(t for t, q in quality.items() if q["trusted"])
    assert all(q["why"] for t, q in quality.items() if t not in trusted)  # each untrusted eval says why
    for cloze in ("prose_cloze", "code_cloze", "arithmetic_cloze"):
        assert cloze not in trusted  # one lm-eval point per run: monotonicity cannot be measured
        assert "monotonicity unmeasured (fewer than 3 checkpoints)" in quality[cloze]["why"]
    runs = lineage.experiment_runs(exp["experiment"])
    assert {(r["variant"], r["seed"]) for r in runs} == {("baseline", 0), ("baseline", 1), ("lr_low", 0), ("lr_low", 1)}
    assert sorted({r["step"] for r in runs if r["task"] == "heldout_math"}) == [2, 4, 6, 8]
    results = {r["task"]: r for r in lineage.experiment_results(exp["experiment"])}
    assert {"heldout_prose", "heldout_code", "heldout_math", "prose_cloze"} <= set(results)
    for task in ("heldout_prose", "heldout_code", "heldout_math"):
        r = results[task]
        assert r["metric"] == "bpb" and r["better"] == "lower" and r["df"] == 2 and r["seed_std"] > 0
        assert r["ci_low"] < r["delta"] < r["ci_high"] and r["trusted"] == (task in trusted)
        finals = {(x["variant"], x["seed"]): x["value"] for x in runs if x["task"] == task and x["step"] == 8}
        assert r["delta"] == pytest.approx(
            (finals["lr_low", 0] + finals["lr_low", 1] - finals["baseline", 0] - finals["baseline", 1]) / 2
        )
        assert r["delta"] > 0  # ten times less learning rate, eight steps: it has learned less
    assert any(results[t]["significant"] for t in trusted), results

    table = PrefectArtifact.get("ablation-comparison-lr-low")
    assert table is not None and table.type == "table"
    assert {row["task"] for row in json.loads(table.data)} == set(results)
    report = PrefectArtifact.get("ablation-report-lr-low")
    assert report is not None and "data:image/png;base64," in report.data

    capsys.readouterr()
    assert main(["experiments", "--workspace", str(ws)]) == 0
    listing = capsys.readouterr().out
    assert exp["experiment"][:12] in listing and "ablation" in listing
    assert main(["experiments", exp["experiment"][:8], "--workspace", str(ws)]) == 0
    assert "## Variants vs baseline" in capsys.readouterr().out
    # The same ablation again would reuse every step (the plan walks the same graph).
    assert (
        main(
            [
                "ablate",
                "tiny",
                *over,
                "--variant",
                VARIANT,
                "--seeds",
                "2",
                "--eval-every",
                "2",
                "--heldout-tokens",
                "4096",
                "--lm-eval",
                "final",
                "--plan",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(steps)} steps: 0 run, {len(steps)} reuse"


def test_bad_variants_fail_before_anything_runs_naming_the_variant(tmp_path, capsys):
    from flows.cli import main

    ws = f"workspace={tmp_path / 'ws'}"
    cases = [
        ("nocolon", "must look like NAME:key=value"),
        ("same:seed=0", "variant same: its overrides ['seed=0'] leave the recipe unchanged"),
        (f"elsewhere:workspace={tmp_path / 'other'}", "variant elsewhere changes workspace"),
        (
            "odd:training.model_overrides.num_heads=3",
            ("variant odd: recipe", "hidden_size=256 is not divisible by num_heads=3"),
        ),
        ("typo:training.learning_rate=1", "variant typo: recipe"),
        ("quiet:training.log_interval=5", "variant quiet: its overrides ['training.log_interval=5'] change only how"),
    ]
    for variant, message in cases:
        assert main(["ablate", "tiny", ws, "--variant", variant, "--plan"]) == 2, variant
        err = capsys.readouterr().err
        for fragment in (message,) if isinstance(message, str) else message:
            assert fragment in err, variant
    assert not (tmp_path / "ws").exists()  # nothing ran, nothing was written


def test_plan_builds_shared_data_once_and_each_variant_its_own_training(tmp_path, capsys):
    from flows.cli import main

    assert (
        main(
            [
                "ablate",
                "tiny",
                f"workspace={tmp_path / 'ws'}",
                "--variant",
                "lr_low:training.optimizer.lr=0.001",
                "--variant",
                "docmask_off:training.doc_masking=false",
                "--seeds",
                "2",
                "--plan",
            ]
        )
        == 0
    )
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert len(keys) == len(set(keys))
    steps = [k.split("[")[0] for k in keys]
    # Data, tokenizer, suite, held-out sets and preflight: the variants change none of them.
    assert steps.count("tokenize") == steps.count("heldout_tokens") == 3 and steps.count("tokenizer") == 1
    assert steps.count("preflight") == steps.count("eval_suite") == 1
    # 3 arms x 2 seeds x 3 pretrain stages, each with its held-out curve; lm-eval after every stage.
    assert steps.count("pretrain") == steps.count("heldout_eval") == steps.count("evaluate") == 18
    assert "pretrain[docmask_off-s1-stage3]" in keys and keys[-1] == "compare[lr_low+docmask_off]"


def test_experiments_lists_nothing_in_an_empty_workspace_and_the_deployment_is_served(tmp_path, capsys):
    from flows.cli import main
    from flows.deployments import deployments

    assert main(["experiments", "--workspace", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("no experiments in")
    assert main(["experiments", "abcd", "--workspace", str(tmp_path)]) == 2
    assert "no experiment 'abcd'" in capsys.readouterr().err
    (ablate,) = [d for d in deployments() if d.name == "on-demand" and "ablation" in d.tags]
    assert ablate.parameters["variants"] == [] and ablate.parameters["seeds"] == 2
