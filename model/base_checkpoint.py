"""A continuation's base checkpoint: find it through lineage, describe its stage, pin its files.

Anneals and continued pretraining (and any experiment that continues a model) start from a
checkpoint another run wrote. What they share lives here, once:

- `resolve_base` picks the checkpoint when the run starts: by default the newest _CHECKPOINT.json
  checkpoint of the latest `smollm3` run (runs of the `full` deployment first) that lies in the
  stable phase of its WSD schedule (`phase="stable"`: anneals), or the final checkpoint of its
  last finished pretrain stage (`phase="last"`: continued pretraining); or an explicit checkpoint
  path, stage folder or checkpoint artifact fingerprint; or (CPT) an HF `save_pretrained` folder.
- `describe_checkpoint` reads what a continuation needs from the checkpoint's stage folder and
  lineage: the stage's own `TrainSpec` (its `spec.json`, loaded as the same type the trainer
  read: nothing is mapped back by hand), the LR at the checkpoint, the stage's mixture weights,
  and the run's token shards, tokenizer and eval suite.
- `link_or_copy` and `write_model_checkpoint` are the files the `pin` step (tasks/pin.py)
  writes: hard links to the checkpoint (copies across filesystems), or a model-only checkpoint
  of an imported HF model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from model.spec import TrainSpec
from pipeline.artifact import read_marker as read_step_marker
from pipeline.workspace import Workspace

if TYPE_CHECKING:  # at run time only where used: duckdb is not needed to read a recipe
    from pipeline.lineage import Lineage


class BaseCheckpoint(BaseModel):
    """A resolved base: which checkpoint, and the stage and data run around it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str  # complete DCP step folder (model + optimizer), or an HF folder (kind hf)
    kind: Literal["checkpoint", "hf"] = "checkpoint"
    digest: str  # identity of these exact weights (manifest hash, or the HF weights' hash)
    stage: str  # stage it belongs to ("hf" for an imported model)
    step: int  # step within that stage
    global_step: int  # position in the run's schedule
    lr: float  # learning rate the run was at when it saved the checkpoint
    spec: TrainSpec  # the data run's stage spec, as the trainer read it
    weights: dict[str, float]  # the stage's normalised mixture weights
    run_id: str | None  # the run that trained it, when lineage knows it
    shards: tuple[str, ...]  # fingerprints of the run's token shards (one artifact per source)
    tokenizer: str  # fingerprint of the fertility/tokenizer artifact the shards were made with
    suite: str | None  # fingerprint of the eval suite built from the same data, if any
    model_shape: dict[str, Any] = {}  # the model's config (an imported HF model need not be a preset)

    @property
    def seq_len(self) -> int:
        return int(self.spec.seq_len or 0)

    @property
    def peak_lr(self) -> float:
        return self.spec.optimizer.lr

    @property
    def label(self) -> str:
        return f"{self.stage}-{self.step}" if self.kind == "checkpoint" else "hf"


# --- finding checkpoints ----------------------------------------------------------------------


def decay_start(spec: TrainSpec) -> int | None:
    """First schedule position whose LR is below the peak (WSD), None for other schedules."""
    s = spec.schedule
    if s.kind != "wsd" or not s.total_steps:
        return None
    return s.total_steps - round(s.decay_fraction * s.total_steps)


def stage_folders(lineage: Lineage, ws: Workspace, run_id: str) -> list[Path]:
    """Pretrain stage folders of a run: its finished stages, plus folders still training (no
    completion marker yet) whose mixture plan is one of the run's mixtures."""
    folders = {a.path for a in lineage.run_outputs(run_id, "pretrain")}
    plans = {str(a.path / "plan.json") for a in lineage.run_outputs(run_id, "mixture")}
    for folder in sorted((ws.path / "pretrain").glob("*")):
        spec_file = folder / "spec.json"
        if folder in folders or read_step_marker(folder) is not None or not spec_file.is_file():
            continue
        try:
            plan = TrainSpec.load(spec_file).mixture_plan
        except (OSError, ValueError):
            continue  # being written this instant: the next resolution sees it
        if plan in plans:
            folders.add(folder)
    return sorted(folders)


def stable_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(global step, step folder) of the complete checkpoints of a stage folder that lie in the
    stable phase of its WSD schedule (global step <= decay start)."""
    from model.checkpoint import Checkpointer, read_marker, read_trainer_state

    start = decay_start(TrainSpec.load(folder / "spec.json"))
    if start is None:
        return []
    found = []
    for ckpt in Checkpointer(folder / "checkpoints").step_folders():
        if read_marker(ckpt) is None:
            continue  # still being written, or truncated
        try:
            global_step = int(read_trainer_state(ckpt)["global_step"])
        except (OSError, ValueError, KeyError):
            continue  # pruned between the listing and this read
        if global_step <= start:
            found.append((global_step, ckpt))
    return found


def _last_stage_checkpoint(lineage: Lineage, run_id: str) -> Path | None:
    from model.checkpoint import resolve_checkpoint

    stages = [a for a in lineage.run_outputs(run_id, "pretrain") if a.meta.get("kind") == "pretrain"]
    return resolve_checkpoint(stages[-1].meta["checkpoint"]) if stages else None


def resolve_base(
    lineage: Lineage,
    ws: Workspace,
    base: str = "",
    *,
    phase: Literal["stable", "last"] = "stable",
    flow: str = "smollm3",
    deployment: str = "full",
    allow_hf: bool = False,
) -> BaseCheckpoint:
    """The base checkpoint of a continuation, resolved now (see the module docstring).

    base: "" for the default of `phase`; a checkpoint path (step folder, checkpoints root or
    stage folder); a pretrain artifact fingerprint (prefix); with `allow_hf`, an HF folder.
    """
    from model.checkpoint import resolve_checkpoint

    run_id = lineage.latest_run(flow, deployment)
    path = Path(base) if base else None
    if path is not None and (path / "config.json").is_file():
        if not allow_hf:
            raise ValueError(f"base {base!r} is an HF folder; this flow needs a trainer checkpoint")
        if run_id is None or (ckpt := _last_stage_checkpoint(lineage, run_id)) is None:
            raise LookupError(f"an HF base needs the data of a finished {flow!r} run in {lineage.path}")
        return describe_hf(lineage, path, ckpt, run_id)
    if path is not None and path.exists():
        return describe_checkpoint(lineage, resolve_checkpoint(path), None)
    if base:
        found = lineage.get(base)
        if found.kind != "checkpoint":
            raise LookupError(f"base {base!r} is a {found.kind} artifact, not a checkpoint")
        return describe_checkpoint(lineage, resolve_checkpoint(found.meta["checkpoint"]), None)
    if run_id is None:
        raise LookupError(
            f"no {flow!r} run in lineage {lineage.path}: train one first, or give an explicit base "
            "checkpoint (path or fingerprint)"
        )
    if phase == "last":
        ckpt = _last_stage_checkpoint(lineage, run_id)
        if ckpt is None:
            raise LookupError(f"run {run_id} has no finished pretrain stage yet; give an explicit base")
        return describe_checkpoint(lineage, ckpt, run_id)
    candidates = [c for folder in stage_folders(lineage, ws, run_id) for c in stable_checkpoints(folder)]
    if not candidates:
        raise LookupError(
            f"run {run_id} has no complete stable-phase checkpoint yet (before the WSD decay); "
            "wait for its first checkpoint or give an explicit base"
        )
    # Newest position in the schedule; the later-written folder breaks a tie.
    _, ckpt = max(candidates, key=lambda c: (c[0], c[1].stat().st_mtime))
    return describe_checkpoint(lineage, ckpt, run_id)


def describe_checkpoint(lineage: Lineage, ckpt: Path, run_id: str | None) -> BaseCheckpoint:
    """Everything a continuation needs to know about a checkpoint inside a pretrain stage folder."""
    from model.checkpoint import MARKER, MODEL_CONFIG, read_trainer_state
    from model.schedule import lr_at

    folder = ckpt.parent.parent
    spec_file = folder / "spec.json"
    if not spec_file.is_file():
        raise FileNotFoundError(
            f"checkpoint {ckpt} is not inside a pretrain stage folder (no {spec_file}); give a "
            "checkpoint written by the pretrain step"
        )
    spec = TrainSpec.load(spec_file)
    state = read_trainer_state(ckpt)
    total = spec.schedule.total_steps or state["global_step"] + 1
    # The LR of the last step before the checkpoint: a continuation decays from where the run was
    # (the peak, in the stable phase), not from the next position, which past a stage's end is 0.
    lr = lr_at(max(int(state["global_step"]) - 1, 0), spec.optimizer.lr, spec.schedule, total)
    plan_path = Path(spec.mixture_plan)
    plan = json.loads(plan_path.read_text())
    mixture = lineage.find_by_path(plan_path.parent)
    if mixture is None:
        raise LookupError(f"the mixture plan {plan_path} of {ckpt} is not in lineage {lineage.path}")
    shards = lineage.inputs_of(mixture.fingerprint, kind="shards")
    if not shards:
        raise LookupError(f"mixture {mixture.short} has no token shards in lineage")
    tok = [a for a in lineage.inputs_of(shards[0].fingerprint) if a.kind in ("fertility", "tokenizer")]
    if not tok:
        raise LookupError(f"shards {shards[0].short} have no tokenizer in lineage")
    total_weight = sum(s["weight"] for s in plan["sources"])
    model_config = json.loads((ckpt / MODEL_CONFIG).read_text()) if (ckpt / MODEL_CONFIG).is_file() else {}
    return BaseCheckpoint(
        checkpoint=str(ckpt),
        digest=hashlib.sha256((ckpt / MARKER).read_bytes()).hexdigest()[:16],
        stage=str(state.get("stage", plan["stage"])),
        step=int(state["step"]),
        global_step=int(state["global_step"]),
        lr=lr,
        spec=spec,
        weights={s["name"]: s["weight"] / total_weight for s in plan["sources"]},
        run_id=run_id,
        shards=tuple(s.fingerprint for s in shards),
        tokenizer=tok[0].fingerprint,
        suite=eval_suite_of(lineage, [s.fingerprint for s in shards]),
        model_shape=model_config,
    )


def describe_hf(lineage: Lineage, folder: Path, data_checkpoint: Path, run_id: str) -> BaseCheckpoint:
    """An HF folder as a base: its weights, with the data context of a run's checkpoint."""
    context = describe_checkpoint(lineage, data_checkpoint, run_id)
    h = hashlib.sha256()  # names, sizes and times of the weights: cheap, and any rewrite shows
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    from transformers import AutoConfig

    from model.hf import from_hf_config

    # AutoConfig keeps the folder's own model_type; the check names what our model cannot hold.
    model_config = from_hf_config(AutoConfig.from_pretrained(str(folder)), f"base HF model {folder}").to_dict()
    if "rope_scaling" in model_config:  # YaRN reads a model past its trained length; training never uses it
        raise ValueError(
            f"base HF model {folder} has rope scaling {model_config['rope_scaling']} (YaRN, for reading past "
            "the trained length): continue from the export without it (remove rope_parameters' YaRN keys "
            "from its config.json)"
        )
    return context.model_copy(
        update={
            "checkpoint": str(folder.resolve()),
            "kind": "hf",
            "digest": h.hexdigest()[:16],
            "stage": "hf",
            "step": 0,
            "global_step": 0,
            "model_shape": model_config,
        }
    )


def eval_suite_of(lineage: Lineage, shards: list[str]) -> str | None:
    """The newest eval suite built from the corpora these shards were tokenized from."""
    suites = [
        (suite, i)
        for shard in shards
        for corpus in lineage.inputs_of(shard, kind="corpus")
        for i, suite in enumerate(lineage.made_from(corpus.fingerprint, step="eval_suite"))
    ]
    return suites[-1][0].fingerprint if suites else None


# --- pinning ----------------------------------------------------------------------------------


def link_or_copy(src: str, dst: str) -> None:
    """Hard-link a checkpoint file, else copy it. Checkpoint files are never rewritten in place
    (a re-save of a step deletes the folder first), so a link pins the data at no cost: the
    main run's retention removes its own name, the pin's name keeps the bytes."""
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def write_model_checkpoint(model, folder: Path) -> Path:
    """A model-only checkpoint in the trainer's format (DCP + config + state + marker), for an
    imported HF model: the trainer loads it with `init_from` and a fresh optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from infra.files import write_atomic
    from model.checkpoint import MARKER, MODEL_CONFIG, TRAINER_STATE

    folder.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_rank0.pt")
    write_atomic(folder / MODEL_CONFIG, json.dumps(model.config.to_dict(), indent=2))
    state = {
        "step": 0,
        "global_step": 0,
        "schedule_start": 0,
        "stage": "hf",
        "stage_end": True,
        "loss": None,
        "world_size": 1,
    }
    write_atomic(folder / TRAINER_STATE, json.dumps(state, indent=2))
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")
    }
    write_atomic(folder / MARKER, json.dumps({"step": 0, "stage_end": True, "files": files}))
    return folder
