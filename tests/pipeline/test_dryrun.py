"""`smollm3 plan` and the graph it shares with the flow: exact run/reuse predictions, the reasons,
and fingerprints that change only when an output would (identity vs operational config fields)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.graphs import plan
from flows.prefect_flows import smollm3
from flows.recipe import Recipe, load_recipe
from flows.smollm3 import graph
from pipeline.artifact import is_operational
from pipeline.dryrun import diff
from tests.conftest import DATA_ONLY

REPO = Path(__file__).resolve().parents[2]


def test_diff_names_changed_fields():
    assert diff({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}, "d": 4}) == ["b.c: 2 -> 3", "d: (new) -> 4"]


def _fingerprints(overrides: list[str]) -> dict[str, str]:
    g = graph(load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan", *overrides]), tolerant=True)
    return {n.key: n.fingerprint for n in g}


# Fields that say how steps run, never what they compute: changing them must rerun nothing.
OPERATIONAL = [
    "training.log_interval=7",
    "training.peak_flops=1e15",
    "training.checkpoint_interval=3",
    "training.keep_last=5",
    "training.num_threads=2",
    "training.micro_batch=4",
    "training.nproc_per_node=2",
    "training.retries=4",
    "training.retry_backoff_s=5",
    "training.retry_backoff_max_s=60",
    "eval.batch_size=64",
    "curation.workers=2",
    "curation.executor=ray",
    "curation.ray.address=ray://10.0.0.1:10001",  # the cluster and its authentication: where, not what
    "tokenize.executor=ray & tokenize.ray.auth=token",
    "tokenizer.executor=ray & tokenizer.ray.cpus_per_task=4",  # where the BPE trains, not what
    "curation.decontamination.index_partitions=4",  # how the held-out index is built, not what
    "curation.min_kept_share=0.5",
    "curation.sample_documents=10",
    "curation.sample_chars=1000",
    "tokenize.workers=3",
    "tokenize.batch_size=10",
    "resources.train.slots=3",
    "resources.eval.threads=2",
    "resources.data.slots=1",
    "launch.kind=slurm",
    "launch.slurm={partition: p}",
    "storage.s3_uri=s3://b/p",
    "preflight.allow_warn=false",
    "posttrain.eval.batch_size=4",
    "stages.stage1.max_epochs=2",
    "training.compile_model=true",
    "training.fused_qkv=false & stages.long1.fused_qkv=true & stages.long1.compile_model=auto",
    # a long run watching itself: hang bounds, flag thresholds, NaN recovery, the tracker
    "training.watchdog={floor_s: 5, grace_s: 1}",
    "training.monitor={straggler_margin: 0.2}",
    "training.nonfinite={retries: 0}",
    "training.tracker={kind: none}",
    "training.loader={open_shards: 4, prefetch: 0}",  # how a rank reads its shards, never which tokens
    # memory and parallelism (several overrides of one case are joined by " & ")
    "training.activation_checkpointing=full",
    "training.loss_chunk_tokens=64",
    "training.async_checkpoint=true",
    "training.hsdp=true",
    "training.gpu_memory_gb=80",
    "training.nproc_per_node=2 & training.tp=2",
    "stages.long1.activation_checkpointing=selective",
    "training.nproc_per_node=2 & stages.long1.tp=2",
    "training.nproc_per_node=2 & training.cp=2",
    "training.nproc_per_node=2 & stages.long1.cp=2",
    "stages.long1.nodes=1",
    # a stage's own operational settings (model/spec.py StageSettings)
    "stages.stage2.micro_batch=4",
    "stages.stage2.loss_chunk_tokens=64 & stages.stage2.async_checkpoint=true & stages.stage2.hsdp=true",
    "stages.stage2.compile_model=true & stages.stage2.num_threads=1 & stages.stage2.peak_flops=1e12",
    "stages.stage2.checkpoint_interval=5 & stages.stage2.keep_last=3 & stages.stage2.log_interval=2",
    "stages.stage2.watchdog={floor_s: 5} & stages.stage2.monitor={window: 3} & stages.stage2.nonfinite={retries: 0}"
    " & stages.stage2.tracker={kind: none} & stages.stage2.loader={prefetch: 5}",
    # post-training: where the trainers run, their micro-batches and checkpoints
    "posttrain.launch={procs_per_node: 2, accelerate_config: configs/accelerate/cpu-ddp.yaml}",
    "posttrain.sft.per_device_batch=4",
    "posttrain.sft.save_steps=3",
    "posttrain.sft.keep_checkpoints=1",
    "posttrain.preference.per_device_batch=2",
    "posttrain.preference.save_steps=2",
    "posttrain.preference.keep_checkpoints=3",
    "posttrain.grpo.per_device_batch=4",
    "posttrain.grpo.save_steps=2",
    "posttrain.grpo.keep_checkpoints=1",
    "posttrain.sao.save_steps=1 & posttrain.sao.keep_checkpoints=1",
    "posttrain.sao.rollout_workers=2 & posttrain.sao.rollout_threads=2 & posttrain.sao.per_device_batch=2",
    "posttrain.sao.rollout_nodes=2 & posttrain.sao.rollout_timeout_s=60 & posttrain.sao.engine=auto",
    "posttrain.pairs.think.batch_size=3 & posttrain.pairs.no_think.batch_size=2",
    "posttrain.pairs.think.chunk_batches=1 & posttrain.pairs.no_think.chunk_batches=5",
    "posttrain.distill.per_device_batch=4",
    "posttrain.distill.save_steps=2",
    "posttrain.distill.keep_checkpoints=1",
]


@pytest.mark.parametrize("override", OPERATIONAL)
def test_an_operational_field_changes_no_fingerprint(override):
    before, after = _fingerprints([]), _fingerprints(override.split(" & "))
    changed = sorted(k for k in before if before[k] != after[k])
    if override.startswith("preflight."):  # preflight's checks are the step's own identity
        assert changed == ["preflight[preflight]"]
        return
    assert changed == [], f"{override} reruns {changed}"


# Identity fields, and exactly the steps whose config uses them: everything downstream of those
# reruns, nothing else does.
IDENTITY = {
    "sources.math.max_documents=150": {"source[math]"},
    # the held-out index holds prose's held-out text in the form its preset keeps: it is rebuilt
    # (and so every source's decontamination reruns), the other sources' curation is not
    "curation.presets.prose=code": {"curate[prose]", "heldout_index[heldout]"},
    "curation.minhash_ngrams=4": {"curate[prose]", "curate[code]", "curate[math]"},
    # decontamination's settings: the index's n-grams, the match rule; no curate step reruns
    "curation.decontamination.ngram=6": {"heldout_index[heldout]"},
    "curation.decontamination.threshold=0.6": {f"decontaminate[{s}]" for s in ("prose", "code", "math")},
    # a filter threshold reruns the curate steps of the sources using that preset only
    "curation.filters.docs.gopher_quality.min_doc_words=100": {"curate[prose]"},
    "curation.filters.code.code_line_length.max_line_length=500": {"curate[code]"},
    "curation.filters.math.length.min_chars=30": {"curate[math]"},
    "training.optimizer.lr=0.001": {
        "pretrain[stage1]",
        "pretrain[stage2]",
        "pretrain[stage3]",
        "pretrain[long1]",
        "pretrain[long2]",
        "pretrain[reasoning]",
    },
    "training.doc_masking=false": {
        "pretrain[stage1]",
        "pretrain[stage2]",
        "pretrain[stage3]",
        "pretrain[long1]",
        "pretrain[long2]",
        "pretrain[reasoning]",
    },
    "stages.long1.rope_theta=300000": {"pretrain[long1]"},
    "stages.long2.doc_masking=false": {"pretrain[long2]"},  # a stage's own identity setting
    "stages.stage2.tokens=200000": {
        "mixture[stage2]",
        "pretrain[stage1]",
        "pretrain[stage2]",
        "pretrain[stage3]",
        "preflight[preflight]",
    },
    "eval.items_per_task=50": {"eval_suite[suite]"},
    "eval.lm_eval_tasks=[hellaswag]": {
        f"evaluate[{s}]" for s in ("stage1", "stage2", "stage3", "long1", "long2", "reasoning")
    }
    | {f"evaluate[{s}]" for s in ("base", "sft", "apo", "apo-s1", "soup", "merge", "grpo", "sao")},
    "posttrain.sft.lr=0.001": {"sft[sft]"},
    "posttrain.pairs.think.max_prompts=6": {"preference_pairs[pairs]"},  # then both APO runs and after
    "eval.long_context_cloze=true": {"evaluate[long1]", "evaluate[long2]", "evaluate[reasoning]"},
    # the reasoning stage's own schedule: that stage, and what follows it (its traces: below)
    "stages.reasoning.lr_scale=0.2": {"pretrain[reasoning]"},
    "seed=3": None,  # the recipe seed: many consumers (math data, shuffles, eval items, init)
}


@pytest.mark.parametrize("override", list(IDENTITY))
def test_an_identity_field_reruns_exactly_its_downstream(override):
    g0 = graph(load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan"]), tolerant=True)
    g1 = graph(load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan", override]), tolerant=True)
    before = {n.key: n for n in g0}
    from pipeline.artifact import identity

    # the steps whose own config (or own facts) changed ...
    direct = {
        n.key for n in g1 if identity(n.config) != identity(before[n.key].config) or n.extra != before[n.key].extra
    }
    expected = IDENTITY[override]
    if expected is not None:
        assert direct == expected
    # ... and everything downstream of them, and nothing else, gets a new fingerprint
    changed = {n.key for n in g1 if n.fingerprint != before[n.key].fingerprint}
    assert changed == g1.descendants(direct) and changed


@pytest.mark.parametrize(
    "override",
    [
        "curation.filters.docs.gopher_quality.min_doc_words=50",  # the docs preset's default
        "curation.filters.docs.c4_quality.filter_curly_bracket=false",  # docs' own default, not C4's
        "curation.filters.web.gopher_quality.min_doc_words=100",  # no tiny source uses web
    ],
)
def test_a_threshold_at_its_default_or_of_an_unused_preset_moves_no_fingerprint(override):
    """Thresholds entered the fingerprint after it was published: at their defaults they leave
    every fingerprint as it was, and a preset no source uses reruns nothing."""
    before, after = _fingerprints([]), _fingerprints([override])
    assert sorted(k for k in before if before[k] != after[k]) == []


def test_every_operational_recipe_field_is_exercised_above():
    """An operational marker on a recipe field is a promise that changing it reruns nothing: each
    marked field is changed by a case of OPERATIONAL (or listed here with why it is not)."""
    not_settable_here = {
        "curation.slurm",
        "tokenize.slurm",
        "tokenizer.slurm",
        "resources.poll_seconds",
        "workspace",
    }  # need a cluster, or move outputs
    marked = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            if is_operational(model, name):
                marked.append(path)
                continue
            ann = field.annotation
            for sub in (ann, *getattr(ann, "__args__", ())):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub, path + ".")

    walk(Recipe, "")
    assert {"training.log_interval", "eval.batch_size", "resources", "launch", "storage"} <= set(marked)
    changed = {part.split("=")[0] for o in OPERATIONAL for part in o.split(" & ")}
    # A list item is named in an override (stages.long1.tp), not in the schema walk (stages.tp).
    changed |= {".".join(c.split(".")[:1] + c.split(".")[2:]) for c in changed if c.startswith("stages.")}
    missing = [
        m for m in marked if m not in not_settable_here and not any(c == m or c.startswith(m + ".") for c in changed)
    ]
    assert missing == []


@pytest.mark.slow
def test_plan_predicts_exactly_what_a_run_does_from_any_process(tmp_path, prefect_harness, workspace_copy):
    from pipeline.lineage import Lineage

    over = [*DATA_ONLY, f"workspace={tmp_path / 'ws'}"]
    before = plan(load_recipe("tiny", over))
    assert {r.action for r in before} == {"run"} and {r.reason for r in before} == {"never built"}
    # The run the plan predicts: the session's build of these overrides from raw sources, made in
    # another folder (tests/conftest.py) and copied here; it built exactly the planned steps.
    ws = workspace_copy("data")
    lineage = Lineage(ws / "lineage.duckdb")
    (build,) = lineage.runs()
    assert {
        (f"{s['step']}[{s['label']}]", s["fingerprint"], s["state"]) for s in lineage.steps_of(build["run_id"])
    } == {(r.key, r.fingerprint, "completed") for r in before}
    smollm3(overrides=over)
    after = plan(load_recipe("tiny", over))
    assert [r.fingerprint for r in after] == [r.fingerprint for r in before]
    assert {r.action for r in after} == {"reuse"}
    # The same plan from the console script in another cwd and from `python -m` in a subprocess:
    # the cache key does not depend on how or where the process started.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    console = Path(sys.executable).parent / "smollm3"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd, cwd in (
        ([str(console), "plan", "tiny", *over], elsewhere),
        ([sys.executable, "-m", "flows.cli", "plan", "tiny", *over], REPO),
    ):
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == f"{len(after)} steps: 0 run, {len(after)} reuse", out.stdout
    changed = {r.key: r for r in plan(load_recipe("tiny", [*over, "sources.math.max_documents=150"]))}
    assert changed["source[math]"].action == "run"
    assert "max_documents: 200 -> 150" in changed["source[math]"].reason
    assert changed["curate[math]"].reason == "inputs changed: source[math] reruns"
    assert changed["source[prose]"].action == "reuse" and changed["source[code]"].action == "reuse"
    # code's curation reads code only; the held-out index reads every source, so the index and
    # every source's decontamination rerun
    assert changed["curate[code]"].action == "reuse"
    assert changed["heldout_index[heldout]"].reason == "inputs changed: source[math] reruns"
    assert changed["decontaminate[code]"].reason == "inputs changed: heldout_index[heldout] reruns"
    # operational changes rerun nothing
    quiet = plan(load_recipe("tiny", [*over, "curation.workers=2", "resources.data.slots=1", "eval.batch_size=2"]))
    assert {r.action for r in quiet} == {"reuse"}
    with pytest.raises(ValueError, match="refresh names unknown step"):
        plan(load_recipe("tiny", over), frozenset({"bogus"}))


def test_the_published_recipe_resolves_without_compute():
    rows = plan(load_recipe("smollm3-3b", ["workspace=/nonexistent-smollm3-plan"]))
    steps = {r.step for r in rows}
    assert {"source", "curate", "tokenize", "mixture", "preflight", "pretrain", "export", "evaluate"} <= steps
    # stages 1-3, the two long-context stages and reasoning mid-training, on its two trace sources
    assert sum(r.step == "pretrain" for r in rows) == 6 and all(r.action == "run" for r in rows)
    assert sum(r.step == "reasoning_data" for r in rows) == 2


def test_other_reasoning_traces_rerun_the_reasoning_stage_and_the_preflight_not_the_earlier_stages():
    """The traces feed the reasoning stage's mixture, which the preflight checks with every other
    stage's (a gate of stage 1, not its input): the earlier stages keep their fingerprints."""
    g0 = graph(load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan"]), tolerant=True)
    g1 = graph(
        load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan", "reasoning_data.reasoning.examples=50"]),
        tolerant=True,
    )
    before = {n.key: n.fingerprint for n in g0}
    changed = {n.key for n in g1 if n.fingerprint != before[n.key]}
    stage = {f"{s}[reasoning]" for s in ("reasoning_data", "mixture", "pretrain", "export", "evaluate")}
    assert stage | {"preflight[preflight]", "sft[sft]", "evaluate[base]"} <= changed
    earlier = ("pretrain[stage", "pretrain[long", "export[stage", "export[long", "source", "curate", "tokenize")
    assert not {k for k in changed if k.startswith(earlier)}


def test_the_evaluation_past_the_trained_length_adds_two_evaluations_and_moves_no_training():
    """`eval.beyond_factor` + `eval.beyond_passkey_words` (docs/model.md "Long context: YaRN"):
    two evaluations of the last stage's export, plain and YaRN; the suite gains the passkey_beyond
    task (its evaluations and the report rerun); no training, export or post-training suite moves.
    Unset (`null`), neither evaluation is in the graph."""
    off = graph(
        load_recipe(
            "tiny", ["workspace=/nonexistent-smollm3-plan", "eval.beyond_factor=null", "eval.beyond_passkey_words=null"]
        ),
        tolerant=True,
    )
    on = graph(
        load_recipe(
            "tiny", ["workspace=/nonexistent-smollm3-plan", "eval.beyond_factor=2", "eval.beyond_passkey_words=1400"]
        ),
        tolerant=True,
    )
    before, after = {n.key: n.fingerprint for n in off}, {n.key: n.fingerprint for n in on}
    assert set(after) - set(before) == {"evaluate[long2-x2]", "evaluate[long2-x2-yarn]"}
    changed = {k for k in before if before[k] != after[k]}
    assert "eval_suite[suite]" in changed and "run_report[smollm3]" in changed
    assert not {k for k in changed if not k.startswith(("eval_suite[suite]", "evaluate[", "run_report["))}
    assert "eval_suite[posttrain]" not in changed and "evaluate[sft]" not in changed
    nodes = {n.key: n for n in on}
    for key, yarn in (("evaluate[long2-x2]", False), ("evaluate[long2-x2-yarn]", True)):
        beyond = nodes[key].config.beyond
        assert (beyond.trained_len, beyond.factor, beyond.yarn) == (1024, 2.0, yarn)
