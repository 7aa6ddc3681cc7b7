"""Fixtures shared by the tests of tasks/: a workspace as a smollm3 run leaves it mid-training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.stage_plan import schedule_stages
from pipeline.artifact import MARKER, Artifact
from pipeline.lineage import StepRow
from pipeline.workspace import Workspace
from tasks.mixture import StageConfig
from tasks.pretrain import TrainingConfig


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
        (folder / "_CHECKPOINT.json").write_text(json.dumps({"step": step, "stage_end": False, "files": files}))
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

    training = TrainingConfig(global_batch=4, micro_batch=4, warmup_steps=2, optimizer={"lr": 3e-3})
    stages = [StageConfig(name=f"stage{i}", mixture="x.yaml", tokens=5 * 4 * 32, seq_len=32) for i in (1, 2, 3)]
    runs = schedule_stages(training, stages)  # 15 steps, decay over the last 5: decay starts at 10
    folders = {}
    for i, run in enumerate(runs, 1):
        plan_dir = root / "mixture" / f"m{i}"
        plan_dir.mkdir(parents=True)
        weights = {"a": 3.0, "b": 1.0} if i == 2 else {"a": 1.0, "b": 1.0}
        (plan_dir / "plan.json").write_text(
            json.dumps(
                {
                    "stage": run.name,
                    "seq_len": 32,
                    "sources": [{"name": k, "weight": v} for k, v in weights.items()],
                }
            )
        )
        plan = Artifact(kind="mixture", uri=str(plan_dir), fingerprint=(f"m{i}" * 32), meta={})
        (plan_dir / MARKER).write_text("{}")
        lineage.record_artifact(plan, "mixture", run.name, {}, shards)
        lineage.record_step(
            StepRow(run_id, "mixture", run.name, plan.fingerprint, "completed", {}, "x", _now(), _now())
        )
        stage_dir = root / "pretrain" / f"p{i}"
        stage_dir.mkdir(parents=True)
        run.spec.bind(plan_dir / "plan.json", stage_dir, None).save(stage_dir / "spec.json")
        folders[run.name] = stage_dir
    # Stage 1 finished (steps 3 and 5 kept); stage 3 (decay) finished at global step 15.
    _checkpoint(folders["stage1"], 3, 3)
    _checkpoint(folders["stage1"], 5, 5)
    _checkpoint(folders["stage3"], 5, 15)
    finals = {"stage1": 5, "stage3": 5}
    for name in ("stage1", "stage3"):
        final = folders[name] / "checkpoints" / f"step_{finals[name]:08d}"
        art = Artifact(
            kind="checkpoint",
            uri=str(folders[name]),
            fingerprint=(name * 16)[:64],
            meta={"kind": "pretrain", "stage": name, "checkpoint": str(final)},
        )
        (folders[name] / MARKER).write_text("{}")
        lineage.record_artifact(art, "pretrain", name, {}, [])
        lineage.record_step(StepRow(run_id, "pretrain", name, art.fingerprint, "completed", {}, "x", _now(), _now()))
    # Stage 2 is training: step 3 (global 8) complete, step 4 (global 9) still being written.
    _checkpoint(folders["stage2"], 3, 8)
    _checkpoint(folders["stage2"], 4, 9, complete=False)
    # A stage folder of another run (its plan is not one of this run's mixtures) is ignored.
    other = root / "pretrain" / "zz"
    other.mkdir()
    (other / "spec.json").write_text(
        json.dumps(
            {
                **json.loads((folders["stage2"] / "spec.json").read_text()),
                "mixture_plan": str(root / "elsewhere" / "plan.json"),
            }
        )
    )
    _checkpoint(other, 4, 9)
    return ws, folders


def _now():
    from datetime import datetime

    return datetime.now()
