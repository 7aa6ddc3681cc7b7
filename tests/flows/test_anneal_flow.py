"""Anneal and CPT flows end to end on the tiny recipe, from a base trained through the real steps.

One module-scoped base run (the smollm3 flow: data, one stable-phase stage, export, eval) at a
size that trains in about a minute on 2 cores, in a copy of the session's finished data steps
(tests/conftest.py `built_workspace`); then
- an anneal with two candidates (math, code): baseline + one run per candidate from the pinned
  base, each exported and scored with lm-eval and held-out loss and bits per byte, and the
  experiment framework's comparison (evals/experiments.py) with real differences in DuckDB
  (`experiments`, `experiment_results`) and in a Prefect table artifact;
- a CPT onto math with 10% replay from the base's HF export: a tenth of the peak LR, fresh
  optimizer, held-out loss on general and math data at every eval interval, forgetting flags in
  the metrics table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.recipe import Recipe
from pipeline.lineage import Lineage
from tests.conftest import TINY_TRAIN

# One 8-step stable-phase stage of a 2-layer, 64-wide model (no decay stage: the run's only
# stage is the anneal base); anneals and CPT of 4 steps each.
OVERRIDES = [
    *TINY_TRAIN,
    "stages=[{name: stage1, mixture: mixtures/tiny/stage1.yaml, tokens: 16384, seq_len: 256}]",
    "training.global_batch=8",
    "training.warmup_steps=2",
    "training.decay_stages=0",
    "training.checkpoint_interval=4",
    "training.model_overrides={hidden_size: 64, intermediate_size: 192, num_layers: 2, num_heads: 2, num_kv_heads: 1}",
    "eval.batch_size=64",
    "anneal.tokens=8192",
    "anneal.seed_runs=0",
    "anneal.heldout_tokens=8192",
    "cpt.tokens=8192",
    "cpt.eval_interval=1",
    "cpt.heldout_tokens=8192",
    # Post-training, where the recipe has it, is another flow's concern: stop at export.
    *(["posttrain=null"] if "posttrain" in Recipe.model_fields else []),
]


# One pytest-xdist worker runs this module, so its module fixture (the base run) is built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("anneal-base")


@pytest.fixture(scope="module")
def base_ws(tmp_path_factory, prefect_harness, built_workspace) -> Path:
    from flows.prefect_flows import smollm3
    from tests.conftest import copy_workspace

    # From a copy of the session's data part of the tiny DAG at these source sizes
    # (tests/conftest.py): the base run reuses its data steps and trains, exports and evaluates.
    ws = copy_workspace(built_workspace("tiny-data"), tmp_path_factory.mktemp("anneal").resolve() / "ws")
    result = smollm3(overrides=[*OVERRIDES, f"workspace={ws}"])
    assert set(result["states"]) == {"completed", "cached"}  # the copy's data steps reused, the rest built
    return ws


@pytest.mark.slow
def test_anneal_two_candidates_compares_against_the_baseline(base_ws, capsys):
    from prefect.artifacts import Artifact as PrefectArtifact

    from flows.prefect_flows import anneal

    # Two train slots: the anneal runs are independent branches and train side by side.
    over = [*OVERRIDES, f"workspace={base_ws}", "resources.train.slots=2", "resources.train.threads=1"]
    result = anneal(overrides=over)
    assert set(result["states"]) == {"completed"}
    lineage = Lineage(base_ws / "lineage.duckdb")

    # The base: stage 1's newest complete checkpoint (step 8 of 8, all stable), pinned by links.
    (pin,) = lineage.query_dicts("SELECT * FROM artifacts WHERE step = 'pin'")
    meta = json.loads(pin["meta"])
    assert (meta["stage"], meta["step"], meta["global_step"]) == ("stage1", 8, 8)
    assert meta["checkpoint"].startswith(str(base_ws / "pin"))
    assert Path(meta["source"]).parent.parent.parent == base_ws / "pretrain"

    # Three anneal runs from the pin, each its own data, LR decaying linearly to 0.
    runs = {
        r["label"]: json.loads(r["meta"])
        for r in lineage.query_dicts(
            "SELECT label, meta FROM artifacts WHERE step = 'pretrain' AND label LIKE 'anneal-%'"
        )
    }
    assert set(runs) == {"anneal-baseline", "anneal-math", "anneal-code"}
    for label, m in runs.items():
        assert m["init_from"] == meta["checkpoint"] and m["steps"] == 4, label
        rows = [
            json.loads(line)
            for line in (Path(m["checkpoint"]).parent.parent / "metrics.jsonl").read_text().splitlines()
        ]
        lrs = [r["lr"] for r in rows]
        assert lrs[-1] == 0.0 and all(a > b for a, b in zip(lrs, lrs[1:], strict=False)), (label, lrs)
    assert runs["anneal-math"]["tokens_per_source"]["math"] > runs["anneal-baseline"]["tokens_per_source"]["math"]
    spans = [
        (s["started"], s["ended"])
        for s in lineage.steps_of(result["run_id"])
        if s["step"] == "pretrain" and s["state"] == "completed"
    ]
    assert len(spans) == 3 and any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a != b), spans

    # `smollm3 plan --flow anneal` resolves the same base and graph: every step reused.
    from flows.graphs import plan
    from flows.recipe import load_recipe

    rows = plan(load_recipe("tiny", over), flow="anneal")
    assert {r.action for r in rows} == {"reuse"} and len(rows) == len(lineage.steps_of(result["run_id"]))

    # The comparison (the experiment framework's, evals/experiments.py): every candidate x task,
    # differences of real scores. seed_runs=0 here: one run per variant, so the seed noise is
    # unknown and no difference is called significant (the eval stderr is still reported).
    (exp,) = lineage.experiments("anneal")
    assert exp["run_id"] == result["run_id"] and exp["base_global_step"] == 8
    assert json.loads(exp["seeds"]) == {"baseline": 1, "math": 1, "code": 1}
    rows = lineage.experiment_results(exp["experiment"])
    assert {r["variant"] for r in rows} == {"math", "code"}
    tasks = {r["task"] for r in rows}
    assert {"prose_cloze", "code_cloze", "arithmetic_cloze"} <= tasks
    assert {"heldout_prose", "heldout_code", "heldout_math"} <= tasks
    for r in rows:
        metric = r["metric"]
        assert metric == ("bpb" if r["task"].startswith("heldout_") else "acc_norm")
        assert r["score"] == pytest.approx(
            next(s[r["task"]][metric] for s in _scores(lineage, f"anneal-{r['variant']}") if r["task"] in s)
        )
        assert r["baseline"] == pytest.approx(
            next(s[r["task"]][metric] for s in _scores(lineage, "anneal-baseline") if r["task"] in s)
        )
        assert r["delta"] == pytest.approx(r["score"] - r["baseline"])
        assert r["df"] == 0 and r["significant"] is None and r["ci_low"] is None and r["stderr"] > 0
        assert r["verdict"].endswith("noise unknown (one seed per variant)")
    bpb = {(r["variant"], r["task"]): r["delta"] for r in rows if r["metric"] == "bpb"}
    assert any(abs(d) > 1e-4 for d in bpb.values())  # the runs really differ
    # 60% math data helps held-out math more than 60% code data does.
    assert bpb[("math", "heldout_math")] < bpb[("code", "heldout_math")]

    table = PrefectArtifact.get("anneal-comparison-stage1-8")
    assert table is not None and table.type == "table"
    assert {row["variant"] for row in json.loads(table.data)} == {"math", "code"}

    # Eval-task quality of the base run, with ranking consistency from this comparison.
    from evals.quality import anneal_consistency
    from evals.quality import main as eval_quality

    taus = anneal_consistency(lineage)
    assert {"prose_cloze", "heldout_math"} <= set(taus) and all(-1 <= t <= 1 for t in taus.values())
    assert eval_quality([str(base_ws)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[3 : out.index("A task is kept when every criterion that could be measured passes:")]
    rows = {line.split()[0]: line for line in table if not line.startswith(" ")}
    assert {"prose_cloze", "code_cloze", "arithmetic_cloze"} <= set(rows)
    # 20 items per task: a binomial stderr of ~0.1 gives SNR far below 20, so none is kept,
    # and each dropped task says so with its value.
    assert all(line.endswith("no") for line in rows.values())
    why = [line for line in table if line.startswith("    dropped: ")]
    assert len(why) == len(rows) and all("noisy: SNR " in line and "<= 20" in line for line in why)


def _scores(lineage: Lineage, label: str) -> list[dict]:
    return [
        json.loads(r["meta"])["scores"]
        for r in lineage.query_dicts("SELECT meta FROM artifacts WHERE kind = 'eval' AND label = ?", [label])
    ]


@pytest.mark.slow
def test_cpt_from_an_hf_folder_tracks_heldout_loss_on_both_domains(base_ws):
    from flows.prefect_flows import cpt

    lineage = Lineage(base_ws / "lineage.duckdb")
    (export,) = lineage.query_dicts("SELECT meta FROM artifacts WHERE step = 'export' AND label = 'stage1'")
    hf_dir = json.loads(export["meta"])["model_dir"]
    (stage1,) = lineage.query_dicts("SELECT fingerprint FROM artifacts WHERE step = 'pretrain' AND label = 'stage1'")
    card = (Path(hf_dir) / "README.md").read_text()  # every export has its model card
    assert "stage `stage1`" in card and f"checkpoint fingerprint: `{stage1['fingerprint']}`" in card
    result = cpt(overrides=[*OVERRIDES, f"workspace={base_ws}"], base=hf_dir)
    assert set(result["states"]) == {"completed"}
    pins = [json.loads(r["meta"]) for r in lineage.query_dicts("SELECT meta FROM artifacts WHERE step = 'pin'")]
    assert [p["base_kind"] for p in pins if p["stage"] == "hf"] == ["hf"]  # imported with model.hf.import_hf
    from flows.graphs import plan
    from flows.recipe import load_recipe

    rows = plan(load_recipe("tiny", [*OVERRIDES, f"workspace={base_ws}"]), flow="cpt", base=hf_dir)
    assert {r.action for r in rows} == {"reuse"}, [(r.key, r.reason) for r in rows if r.action == "run"]
    (stage,) = lineage.query_dicts("SELECT uri, meta FROM artifacts WHERE step = 'pretrain' AND label = 'cpt'")
    spec = json.loads((Path(stage["uri"]) / "spec.json").read_text())
    assert spec["optimizer"]["lr"] == pytest.approx(0.1 * 0.003)  # a tenth of the base peak
    assert spec["reset_optimizer"] and spec["reset_schedule"]
    assert spec["schedule"]["kind"] == "wsd" and spec["schedule"]["warmup_steps"] == 2

    (monitor,) = lineage.query_dicts("SELECT fingerprint, meta FROM artifacts WHERE step = 'cpt_monitor'")
    history = json.loads(monitor["meta"])["history"]
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]  # the base, then every eval interval
    assert history[-1]["domain"] < history[0]["domain"]  # the new domain is learned
    assert all(isinstance(h["forgetting"], bool) and "general_rise" in h for h in history)
    tracked = lineage.query(
        "SELECT name, count(*) FROM metrics WHERE fingerprint = ? GROUP BY name ORDER BY name",
        [monitor["fingerprint"]],
    )
    assert tracked == [("forgetting", 5), ("heldout_loss_domain", 5), ("heldout_loss_general", 5)]
    (model,) = lineage.query_dicts("SELECT meta FROM artifacts WHERE step = 'export' AND label = 'cpt'")
    assert (Path(json.loads(model["meta"])["model_dir"]) / "config.json").is_file()
