"""Anneal helpers: base-checkpoint resolution through lineage (stable phase, running stages,
incomplete checkpoints), pinning, the 40/60 blend, the linear-decay launch, and the comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from infra.artifact import MARKER, Artifact
from infra.lineage import StepRow
from infra.workspace import Workspace
from model.schedule import lr_at
from model.spec import ScheduleSpec
from tasks.anneal import (
    AnnealCandidate,
    AnnealConfig,
    anneal_runs,
    anneal_stage,
    blend,
    compare,
    pin_checkpoint,
    resolve_base,
)
from tasks.mixture import StageConfig
from tasks.pretrain import TrainingConfig, schedule_stages, trainer_spec


def _artifact(ws: Path, step: str, name: str, kind: str, meta: dict | None = None) -> Artifact:
    folder = ws / step / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("{}")
    return Artifact(kind=kind, uri=str(folder), fingerprint=(name * 64)[:64], meta=meta or {})


def _checkpoint(stage_dir: Path, step: int, global_step: int, complete: bool = True) -> Path:
    """A checkpoint folder in model/checkpoint.py's format (marker with a file manifest)."""
    folder = stage_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    state = {"step": step, "global_step": global_step, "schedule_start": global_step - step, "stage": "s"}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    if complete:
        files = {"trainer_state.json": (folder / "trainer_state.json").stat().st_size}
        (folder / "COMPLETE").write_text(json.dumps({"step": step, "stage_end": False, "files": files}))
    return folder


@pytest.fixture
def run_ws(tmp_path):
    """A workspace as a smollm3 run leaves it mid-training: stage 1 finished, stage 2 still
    training (no step marker), stage 3 (the decay) finished in an earlier attempt, plus a stage
    folder of another run."""
    ws = Workspace.at(tmp_path / "ws")
    lineage = ws.lineage()
    root = ws.path
    run_id = "run-1"
    lineage.start_run(run_id, "smollm3", "full", "tiny", {})
    corpus = _artifact(root, "curate", "c", "corpus", {"source": "a"})
    tok = _artifact(root, "tokenizer", "t", "tokenizer")
    shards = [_artifact(root, "tokenize", n, "shards", {"source": n}) for n in ("a", "b")]
    suite = _artifact(root, "eval_suite", "e", "eval")
    lineage.record_artifact(corpus, "curate", "a", {})
    lineage.record_artifact(tok, "tokenizer", "bpe", {})
    for s in shards:
        lineage.record_artifact(s, "tokenize", s.meta["source"], {}, [tok, corpus])
    lineage.record_artifact(suite, "eval_suite", "suite", {}, [corpus])

    training = TrainingConfig(global_batch=4, micro_batch=4, warmup_steps=2)
    stages = [StageConfig(name=f"stage{i}", mixture="x.yaml", tokens=5 * 4 * 32, seq_len=32) for i in (1, 2, 3)]
    runs = schedule_stages(training, stages)  # 15 steps, decay over the last 5: decay starts at 10
    folders = {}
    for i, run in enumerate(runs, 1):
        plan_dir = root / "mixture" / f"m{i}"
        plan_dir.mkdir(parents=True)
        weights = {"a": 3.0, "b": 1.0} if i == 2 else {"a": 1.0, "b": 1.0}
        (plan_dir / "plan.json").write_text(json.dumps({
            "stage": run.stage.name, "seq_len": 32,
            "sources": [{"name": k, "weight": v} for k, v in weights.items()],
        }))
        plan = Artifact(kind="mixture", uri=str(plan_dir), fingerprint=(f"m{i}" * 32), meta={})
        (plan_dir / MARKER).write_text("{}")
        lineage.record_artifact(plan, "mixture", run.stage.name, {}, shards)
        lineage.record_step(StepRow(run_id, "mixture", run.stage.name, plan.fingerprint, "completed", {}, "x",
                                    _now(), _now()))
        stage_dir = root / "pretrain" / f"p{i}"
        stage_dir.mkdir(parents=True)
        (stage_dir / "spec.json").write_text(json.dumps(trainer_spec(run, plan_dir / "plan.json", stage_dir, None)))
        folders[run.stage.name] = stage_dir
    # Stage 1 finished (steps 3 and 5 kept); stage 3 (decay) finished at global step 15.
    _checkpoint(folders["stage1"], 3, 3)
    _checkpoint(folders["stage1"], 5, 5)
    _checkpoint(folders["stage3"], 5, 15)
    for name in ("stage1", "stage3"):
        art = Artifact(kind="checkpoint", uri=str(folders[name]), fingerprint=(name * 16)[:64], meta={})
        (folders[name] / MARKER).write_text("{}")
        lineage.record_artifact(art, "pretrain", name, {})
        lineage.record_step(StepRow(run_id, "pretrain", name, art.fingerprint, "completed", {}, "x", _now(), _now()))
    # Stage 2 is training: step 3 (global 8) complete, step 4 (global 9) still being written.
    _checkpoint(folders["stage2"], 3, 8)
    _checkpoint(folders["stage2"], 4, 9, complete=False)
    # A stage folder of another run (its plan is not one of this run's mixtures) is ignored.
    other = root / "pretrain" / "zz"
    other.mkdir()
    (other / "spec.json").write_text(json.dumps({**json.loads((folders["stage2"] / "spec.json").read_text()),
                                                  "mixture_plan": str(root / "elsewhere" / "plan.json")}))
    _checkpoint(other, 4, 9)
    return ws, folders


def _now():
    from datetime import datetime

    return datetime.now()


def test_default_base_is_the_newest_complete_stable_checkpoint_of_a_running_stage(run_ws):
    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws, AnnealConfig())
    assert Path(base.checkpoint) == folders["stage2"] / "checkpoints" / "step_00000003"
    assert (base.stage, base.step, base.global_step, base.run_id) == ("s", 3, 8, "run-1")
    assert base.weights == {"a": 0.75, "b": 0.25}  # the running stage's own mixture, normalised
    assert base.lr == pytest.approx(3e-3)  # stable phase: the peak
    assert len(base.shards) == 2 and base.suite == ("e" * 64)
    # Once stage 2 finishes more checkpoints, a new anneal takes the newer one ...
    _checkpoint(folders["stage2"], 5, 10)
    assert resolve_base(ws.lineage(), ws, AnnealConfig()).global_step == 10
    # ... but never one inside the decay.
    _checkpoint(folders["stage2"], 6, 11)
    assert resolve_base(ws.lineage(), ws, AnnealConfig()).global_step == 10


def test_explicit_base_and_errors(run_ws, tmp_path):
    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws, AnnealConfig(), str(folders["stage1"]))
    assert base.step == 5 and base.global_step == 5
    # A context-extension checkpoint keeps its RoPE base in the anneal.
    spec = folders["stage1"] / "spec.json"
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "rope_theta": 2e6}))
    base = resolve_base(ws.lineage(), ws, AnnealConfig(), str(folders["stage1"]))
    runs = anneal_runs(AnnealConfig(candidates=(AnnealCandidate(name="b", weights={"b": 1}),)), base)
    assert anneal_stage(AnnealConfig(), base, runs[-1]).rope_theta == 2e6
    with pytest.raises(LookupError, match="neither an existing path nor the fingerprint"):
        resolve_base(ws.lineage(), ws, AnnealConfig(), "feedface")
    empty = Workspace.at(tmp_path / "empty")
    with pytest.raises(LookupError, match="no 'smollm3' run"):
        resolve_base(empty.lineage(), empty, AnnealConfig())


def test_pin_copies_the_checkpoint_so_pruning_the_original_does_not_matter(run_ws, tmp_path):
    import shutil

    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws, AnnealConfig())
    out = tmp_path / "pin"
    meta = pin_checkpoint(base, out)
    pinned = Path(meta["checkpoint"])
    # Same filesystem: pinned by hard links, so a multi-GB checkpoint costs no copy.
    assert (pinned / "trainer_state.json").stat().st_nlink == 2
    shutil.rmtree(base.checkpoint)  # the main run's retention deletes it
    from model.checkpoint import read_marker

    assert read_marker(pinned) is not None
    assert meta["global_step"] == 8 and meta["source"] == base.checkpoint
    assert json.loads((pinned / "trainer_state.json").read_text())["global_step"] == 8


def test_blend_is_40_percent_current_60_percent_candidate():
    assert blend({"a": 3, "b": 1}, {"c": 2}, 0.6) == {"a": 0.3, "b": 0.1, "c": 0.6}
    assert blend({"a": 1}, {"a": 1}, 0.6) == {"a": 1.0}
    with pytest.raises(ValueError, match="candidate mixture weights"):
        blend({"a": 1}, {"c": 0}, 0.6)


def test_runs_are_baseline_seed_replicas_and_candidates_with_linear_decay(run_ws):
    ws, _ = run_ws
    base = resolve_base(ws.lineage(), ws, AnnealConfig())
    cfg = AnnealConfig(candidates=(AnnealCandidate(name="code", weights={"b": 1}),), tokens=4 * 32 * 8, seed_runs=2)
    runs = anneal_runs(cfg, base)
    assert [(r.label, r.candidate, r.seed) for r in runs] == [
        ("baseline", "baseline", 0), ("baseline-s1", "baseline", 1), ("baseline-s2", "baseline", 2),
        ("code", "code", 0),
    ]
    assert runs[-1].mixture.weights == {"a": 0.3, "b": 0.7}
    stage = anneal_stage(cfg, base, runs[-1])
    spec = trainer_spec(stage, Path("plan.json"), Path("out"), "ckpt")
    assert stage.steps == 8 and spec["reset_optimizer"] is False  # continue with the optimizer state
    sched = ScheduleSpec(**spec["schedule"])
    lrs = [lr_at(p, spec["optimizer"]["lr"], sched, sched.total_steps) for p in range(stage.steps)]
    assert lrs[0] == pytest.approx(base.lr * 7 / 8) and lrs[-1] == 0.0
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))  # linear decay to 0
    with pytest.raises(ValueError, match="anneal.candidates is empty"):
        anneal_runs(AnnealConfig(), base)


def test_compare_deltas_noise_and_direction():
    def s(acc, se, loss=None):
        out = {"t": {"acc_norm": acc, "acc_norm_stderr": se}}
        if loss is not None:
            out["heldout_x"] = {"loss": loss, "loss_stderr": 0.001}
        return out

    rows = compare([s(0.50, 0.03, 3.0)], {"good": s(0.70, 0.04, 2.9), "same": s(0.52, 0.03, 3.0005)})
    by = {(r["candidate"], r["task"]): r for r in rows}
    good = by[("good", "t")]
    assert good["delta"] == pytest.approx(0.2) and good["noise"] == pytest.approx(0.05)
    assert good["z"] == pytest.approx(4.0) and good["significant"] and good["improved"]
    assert not by[("same", "t")]["significant"]
    loss = by[("good", "heldout_x")]
    assert loss["metric"] == "loss" and loss["better"] == "lower" and loss["improved"]
    # With seed replicas, seed noise dominates a tiny binomial stderr.
    rows = compare([s(0.50, 0.001), s(0.54, 0.001)], {"c": s(0.56, 0.001)})
    assert rows[0]["seed_std"] == pytest.approx(math.sqrt(0.0008))
    assert rows[0]["noise"] == pytest.approx(math.sqrt(2) * rows[0]["seed_std"])
    assert rows[0]["delta"] == pytest.approx(0.04) and not rows[0]["significant"]


def test_recipe_rejects_candidates_naming_unknown_sources():
    from tasks.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"anneal.candidates\[x\] names unknown source\(s\) nope"):
        load_recipe("tiny", ["anneal.candidates=[{name: x, weights: {nope: 1}}]"])
