"""Continued pretraining (CPT): a trained model onto a new domain, watching for forgetting.

The playbook's recipe: LR about a tenth of the original peak, a short warmup, a fresh optimizer
state, replay of general data (default 10%) mixed into the new-domain data, a WSD decay at the
end, and held-out loss tracked on both the old (general) and the new domain. Here:

- the base is a checkpoint written by the pretrain step (path or fingerprint), an HF
  `save_pretrained` folder (converted with `model.hf.import_hf` by the `cpt_base` step), or by
  default the last pretrain stage of the latest smollm3 run; the data (shards, tokenizer,
  held-out text) comes from that run through lineage;
- `cpt_weights` blends the domain and general weights; `cpt_stage` lays out the launch;
- `heldout_tokens` (step, tasks/heldout.py) tokenizes the held-out split of the general and of
  the new-domain sources with the run's tokenizer, so the loss is measured on unseen text;
- the stage checkpoints every `eval_interval` steps and keeps them all; `cpt_monitor` (step)
  computes the held-out loss of the base and of every interval checkpoint on both domains, and
  `forgetting_flags` marks the checkpoints whose general loss rose more than `threshold`
  (relative) above the base's. Scores go to DuckDB `metrics` and to a Prefect table artifact.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.artifact import Artifact
from infra.lineage import Lineage
from infra.workspace import Workspace
from tasks.anneal import BaseCheckpoint, describe_checkpoint, latest_run, link_or_copy
from tasks.heldout import HeldoutConfig, heldout_loss
from tasks.mixture import StageConfig
from tasks.pretrain import StageRun
from tasks.step import step


class CptConfig(BaseModel):
    """The recipe's `cpt` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: dict[str, float] = {}  # new-domain data: source name -> weight
    general: dict[str, float] = {}  # general data replayed; empty = the base stage's mixture minus the domain
    replay: float = Field(default=0.1, ge=0, lt=1)  # share of general data in the CPT mixture
    lr_fraction: float = Field(default=0.1, gt=0, le=1)  # peak LR = this x the base run's peak (1/10-1/4)
    warmup_steps: int = Field(default=2, ge=0)  # short warmup of the fresh schedule
    decay_fraction: float = Field(default=0.2, ge=0, le=1)  # WSD: share of the steps decaying to 0
    tokens: int = Field(default=32768, gt=0)  # tokens of the CPT run
    eval_interval: int = Field(default=5, gt=0)  # steps between held-out evaluations (checkpoints)
    heldout_tokens: int = Field(default=16384, gt=0)  # held-out tokens per domain (cap)
    eval_batch: int = Field(default=8, gt=0)  # sequences per held-out forward pass
    forgetting_threshold: float = Field(default=0.05, gt=0)  # relative rise of general loss that flags

    @field_validator("domain", "general")
    @classmethod
    def _non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, w in value.items() if not w >= 0 or math.isinf(w))
        if bad:
            raise ValueError(f"weights must be finite and >= 0; bad: {', '.join(bad)}")
        return value

    def check_sources(self, sources: Sequence[str]) -> None:
        """cpt.domain and cpt.general name recipe sources (checked when the recipe loads)."""
        for section in ("domain", "general"):
            unknown = sorted(set(getattr(self, section)) - set(sources))
            if unknown:
                raise ValueError(
                    f"cpt.{section} names unknown source(s) {', '.join(unknown)}; sources: {', '.join(sources)}"
                )


# --- the base ---------------------------------------------------------------------------------


class CptBase(BaseModel):
    """The resolved CPT base: where the weights come from, and the data run around them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str  # checkpoint step folder or HF folder
    kind: str  # "checkpoint" or "hf"
    digest: str  # identity of the weights (marker hash, or hash of the safetensors sizes/mtimes)
    context: BaseCheckpoint  # the data run's stage context (shards, tokenizer, training, weights)


def resolve_cpt_base(lineage: Lineage, ws: Workspace, base: str = "", flow: str = "smollm3",
                     nproc_per_node: int = 1) -> CptBase:
    """base: "" = the last pretrain stage of the latest run; a checkpoint path; an HF folder; or a
    checkpoint artifact fingerprint. The data context is the latest run's last pretrain stage
    when the base itself carries none (an HF folder)."""
    from model.checkpoint import resolve_checkpoint

    def last_stage() -> Path:
        run_id = latest_run(lineage, flow, "full")
        rows = lineage.query(
            "SELECT a.meta FROM steps s JOIN artifacts a ON a.fingerprint = s.fingerprint "
            "WHERE s.run_id = ? AND s.step = 'pretrain' AND s.state IN ('completed', 'cached') "
            "AND json_extract_string(a.meta, '$.kind') = 'pretrain' ORDER BY s.ended DESC LIMIT 1",
            [run_id],
        ) if run_id else []
        if not rows:
            raise LookupError(
                f"no finished pretrain stage of a {flow!r} run in {lineage.path}: train one, or give "
                "cpt an explicit base (checkpoint path, HF folder or fingerprint)"
            )
        return resolve_checkpoint(json.loads(rows[0][0])["checkpoint"])

    path = Path(base) if base else None
    if path is not None and (path / "config.json").is_file():
        digest = hashlib.sha256(
            "".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(path.glob("*.safetensors"))).encode()
        ).hexdigest()[:16]
        context = describe_checkpoint(lineage, last_stage(), None, nproc_per_node)
        return CptBase(source=str(path.resolve()), kind="hf", digest=digest, context=context)
    if not base:
        ckpt = last_stage()
    elif path is not None and path.exists():
        ckpt = resolve_checkpoint(path)
    else:
        row = lineage.artifact(base)
        if row is None or row["kind"] != "checkpoint":
            raise LookupError(f"cpt base {base!r} is neither a path nor a checkpoint fingerprint in {lineage.path}")
        ckpt = resolve_checkpoint(json.loads(row["meta"])["checkpoint"])
    context = describe_checkpoint(lineage, ckpt, None, nproc_per_node)
    return CptBase(source=str(ckpt), kind="checkpoint", digest=context.digest, context=context)


def write_model_checkpoint(model, folder: Path) -> Path:
    """A model-only checkpoint in the trainer's format (DCP + config + state + marker), for an
    imported HF model: the trainer loads it with `init_from` and a fresh optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from model.checkpoint import MARKER, MODEL_CONFIG, TRAINER_STATE, atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_rank0.pt")
    atomic_write_text(folder / MODEL_CONFIG, json.dumps(model.config.to_dict(), indent=2))
    state = {"step": 0, "global_step": 0, "schedule_start": 0, "stage": "hf", "stage_end": True,
             "loss": None, "world_size": 1}
    atomic_write_text(folder / TRAINER_STATE, json.dumps(state, indent=2))
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}
    atomic_write_text(folder / MARKER, json.dumps({"step": 0, "stage_end": True, "files": files}))
    return folder


def build_cpt_base(config: CptBase, out: Path, log=print) -> dict[str, Any]:
    """Pin the base: copy a checkpoint, or convert an HF folder into one."""
    import shutil

    from model.checkpoint import MODEL_CONFIG, read_marker

    target = out / "checkpoint" / "step_00000000"
    if config.kind == "hf":
        from model.hf import import_hf

        write_model_checkpoint(import_hf(config.source), target)
        log(f"imported HF model {config.source} into {target}")
    else:
        target = out / "checkpoint" / Path(config.source).name
        shutil.copytree(config.source, target, copy_function=link_or_copy)
        if read_marker(target) is None:
            raise RuntimeError(f"the copy of {config.source} fails its manifest; rerun cpt")
        log(f"pinned {config.source} to {target}")
    model_config = json.loads((target / MODEL_CONFIG).read_text())
    return {"checkpoint": str(target), "source": config.source, "stage": "cpt-base",
            "kind": config.kind, "model_config": model_config}


@step("cpt_base", version=1, kind="checkpoint")
def cpt_base(config: CptBase, inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Prefect task: pin (copy or import) the CPT base as a trainer checkpoint."""
    return build_cpt_base(config, out, log)


# --- mixture and launch -----------------------------------------------------------------------


def general_weights(cfg: CptConfig, base_weights: Mapping[str, float]) -> dict[str, float]:
    """The general data to replay: the recipe's choice, else the base stage's minus the domain."""
    weights = dict(cfg.general) or {k: v for k, v in base_weights.items() if k not in cfg.domain}
    if cfg.replay > 0 and not any(w > 0 for w in weights.values()):
        raise ValueError(
            f"cpt.replay is {cfg.replay} but there is no general data to replay (base mixture "
            f"{dict(base_weights)} minus cpt.domain {sorted(cfg.domain)}); set cpt.general"
        )
    return weights


def cpt_weights(cfg: CptConfig, general: Mapping[str, float]) -> dict[str, float]:
    """(1 - replay) x new-domain data + replay x general data, each normalised first."""
    if not any(w > 0 for w in cfg.domain.values()):
        raise ValueError("cpt.domain names no new-domain source with a positive weight (e.g. cpt.domain={math: 1})")
    out: dict[str, float] = {}
    for weights, part in ((cfg.domain, 1 - cfg.replay), (general, cfg.replay)):
        total = sum(weights.values())
        for name, w in weights.items():
            if total > 0 and part > 0:
                out[name] = out.get(name, 0.0) + part * w / total
    return {k: round(v, 10) for k, v in sorted(out.items()) if v > 0}


def cpt_stage(cfg: CptConfig, base: BaseCheckpoint, model_config: Mapping[str, Any]) -> StageRun:
    """The CPT launch: fresh optimizer and WSD schedule at lr_fraction x the base peak LR, a
    checkpoint every eval_interval steps, all kept for the held-out evaluation."""
    steps = max(1, math.ceil(cfg.tokens / (base.training.global_batch * base.seq_len)))
    keep = steps // cfg.eval_interval + 1
    # The model shape comes from the base's own checkpoint (an imported HF model need not be a preset).
    overrides = {k: v for k, v in model_config.items() if k != "max_seq_len"}
    training = base.training.model_copy(update={
        "checkpoint_interval": cfg.eval_interval, "keep_last": keep, "min_lr": 0.0,
        "model_overrides": overrides,
    })
    stage = StageConfig(name="cpt", mixture="weights:cpt", tokens=cfg.tokens, seq_len=base.seq_len)
    return StageRun(
        stage=stage, training=training, kind="pretrain", steps=steps, schedule="wsd",
        lr=base.peak_lr * cfg.lr_fraction, warmup_steps=min(cfg.warmup_steps, steps),
        decay_fraction=cfg.decay_fraction, total_steps=steps, start_step=0, rope_theta=None, fresh=True,
    )


# --- held-out loss and forgetting ----------------------------------------------------------


def heldout_configs(cfg: CptConfig, general: Mapping[str, float]) -> list[HeldoutConfig]:
    """The two held-out sets the monitor compares: general (replayed) data and the new domain."""
    return [
        HeldoutConfig(domain=d, sources=tuple(sorted(k for k, v in w.items() if v > 0)), max_tokens=cfg.heldout_tokens)
        for d, w in (("general", general), ("domain", cfg.domain))
    ]


def forgetting_flags(history: Sequence[Mapping[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """Each evaluation with its general-loss rise over the first row (the base model) and a
    `forgetting` flag when that relative rise exceeds `threshold`.

    history: rows {step, general, domain} in step order, the first one the base (step 0).
    """
    if not history:
        return []
    base = float(history[0]["general"])
    if not base > 0:
        raise ValueError(f"forgetting_flags: the base general loss must be > 0, got {base}")
    flagged = []
    for row in history:
        rise = (float(row["general"]) - base) / base
        flagged.append({**row, "general_rise": rise, "forgetting": rise > threshold})
    return flagged


def build_monitor(cfg: CptConfig, inputs: Sequence[Artifact], out: Path, log=print) -> dict[str, Any]:
    """Held-out loss of the base and of every kept CPT checkpoint, on both domains."""
    import numpy as np
    import torch

    from model.checkpoint import Checkpointer, load_model, read_marker

    base, stage = (a for a in inputs if a.kind == "checkpoint")
    held = {a.meta["domain"]: a for a in inputs if a.kind == "shards"}
    data = {d: np.load(held[d].meta["file"]) for d in ("general", "domain") if d in held}
    eos = int(next(iter(held.values())).meta["eos_id"])
    seq_len = int(json.loads((stage.path / "spec.json").read_text())["seq_len"])
    points = [(0, Path(base.meta["checkpoint"]))] + [
        (int(f.name[5:]), f) for f in Checkpointer(stage.path / "checkpoints").step_folders()
        if read_marker(f) is not None
    ]
    torch.manual_seed(0)
    history = []
    for step_no, folder in points:
        model = load_model(folder)
        row = {"step": step_no}
        for domain, tokens in data.items():
            row[domain] = heldout_loss(model, tokens, seq_len, cfg.eval_batch, eos)[0]
        history.append(row)
        log(f"cpt held-out loss at step {step_no}: " + ", ".join(f"{d} {row[d]:.4f}" for d in data))
    rows = forgetting_flags(history, cfg.forgetting_threshold)
    first = next((r["step"] for r in rows if r["forgetting"]), None)
    (out / "history.json").write_text(json.dumps(rows, indent=2))
    if first is not None:
        log(f"FORGETTING: general held-out loss rose more than {cfg.forgetting_threshold:.0%} over the "
            f"base by step {first}; raise cpt.replay or lower cpt.lr_fraction")
    return {"history": rows, "forgetting": first is not None, "first_forgetting_step": first,
            "threshold": cfg.forgetting_threshold,
            "domain_gain": rows[0].get("domain", 0) - rows[-1].get("domain", 0) if "domain" in data else None}


def publish_monitor(artifact: Artifact, ws, label: str) -> None:
    """Held-out losses to DuckDB `metrics`; the history with its flags to a Prefect table."""
    from prefect.artifacts import create_table_artifact

    rows = artifact.meta["history"]
    facts = [(artifact.fingerprint, r["step"], f"heldout_loss_{d}", float(r[d]))
             for r in rows for d in ("general", "domain") if d in r]
    facts += [(artifact.fingerprint, r["step"], "forgetting", float(r["forgetting"])) for r in rows]
    ws.lineage().record_rows("metrics", facts)
    table = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    create_table_artifact(table=table, key=f"cpt-heldout-{label}".lower().replace("_", "-"),
                          description="CPT held-out loss (general vs domain) and forgetting flags")


@step("cpt_monitor", version=1, kind="eval", publish=publish_monitor)
def cpt_monitor(config: CptConfig, inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Prefect task: (base checkpoint, CPT stage, held-out tokens) -> loss history and flags."""
    return build_monitor(config, tuple(inputs), out, log)
