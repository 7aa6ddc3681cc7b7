"""Continued pretraining (CPT): a trained model onto a new domain, watching for forgetting.

The playbook's recipe: LR about a tenth of the original peak, a short warmup, a fresh optimizer
state, replay of general data (default 10%) mixed into the new-domain data, a WSD decay at the
end, and held-out loss tracked on both the old (general) and the new domain. Here:

- the base (model/base_checkpoint.py, pinned by tasks/pin.py) is a checkpoint written by the
  pretrain step (path or fingerprint), an HF `save_pretrained` folder (imported by the `pin`
  step), or by default the final checkpoint of the last pretrain stage of the latest smollm3 run;
  the data (shards, tokenizer, held-out text) comes from that run through lineage;
- `cpt_weights` (flows/cpt.py) blends the domain and general weights; `cpt_stage` is the launch:
  the base stage's own TrainSpec with a fresh optimizer and schedule at `lr_fraction` x its peak LR;
- `heldout_tokens` (tasks/heldout.py) tokenizes the held-out split of the general and of the
  new-domain sources with the run's tokenizer, so the loss is measured on unseen text;
- the stage keeps a checkpoint every `eval_interval` steps; `cpt_monitor` (step) computes the
  held-out loss of the base and of every kept checkpoint on both domains, and
  `forgetting_flags` (evals/forgetting.py) marks the checkpoints whose general loss rose more
  than `threshold` (relative) above the base's. Scores go to DuckDB `metrics` and to a Prefect
  table artifact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from evals.forgetting import forgetting_flags
from evals.heldout_loss import heldout_loss
from model.spec import TrainSpec
from pipeline.artifact import Artifact
from pipeline.step import step


class CptConfig(BaseModel):
    """The recipe's `cpt` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: dict[str, float] = {}  # new-domain data: source name -> weight
    general: dict[str, float] = {}  # general data replayed; empty = the base stage's mixture minus the domain
    replay: float = Field(default=0.1, ge=0, lt=1)  # share of general data in the CPT mixture
    lr_fraction: float = Field(default=0.1, gt=0, le=1)  # peak LR = this x the base run's peak (1/10-1/4)
    warmup_steps: int = Field(default=2, ge=0)  # short warmup of the fresh schedule
    decay_fraction: float = Field(default=0.2, ge=0, le=1)  # WSD: share of the steps decaying to 0
    tokens: int = Field(default=32768, gt=0, le=10**15)  # tokens of the CPT run
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


def publish_monitor(artifact: Artifact, ws, label: str) -> None:
    """Held-out losses to DuckDB `metrics`; the history with its flags to a Prefect table."""
    from prefect.artifacts import create_table_artifact

    rows = artifact.meta["history"]
    facts = [
        (artifact.fingerprint, r["step"], f"heldout_loss_{d}", float(r[d]))
        for r in rows
        for d in ("general", "domain")
        if d in r
    ]
    facts += [(artifact.fingerprint, r["step"], "forgetting", float(r["forgetting"])) for r in rows]
    ws.lineage().record_rows("metrics", facts)
    table = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    create_table_artifact(
        table=table,
        key=f"cpt-heldout-{label}".lower().replace("_", "-"),
        description="CPT held-out loss (general vs domain) and forgetting flags",
    )


@step("cpt_monitor", version=2, kind="eval", publish=publish_monitor, resource="eval", isolate=True)
def cpt_monitor(
    config: CptConfig, base: Artifact, stage: Artifact, heldout: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """Held-out loss of the `base` and of every kept checkpoint of the CPT `stage` on both
    held-out token sets (`heldout`): the loss history and its forgetting flags."""
    import numpy as np
    import torch

    from model.checkpoint import Checkpointer, load_model, read_marker

    held = {a.meta["domain"]: a for a in heldout}
    data = {d: np.load(held[d].meta["file"]) for d in ("general", "domain") if d in held}
    eos = int(next(iter(held.values())).meta["eos_id"])
    seq_len = int(TrainSpec.load(stage.path / "spec.json").seq_len or 0)
    points = [(0, Path(base.meta["checkpoint"]))] + [
        (int(f.name[5:]), f)
        for f in Checkpointer(stage.path / "checkpoints").step_folders()
        if read_marker(f) is not None
    ]
    torch.manual_seed(0)
    history = []
    for step_no, folder in points:
        model = load_model(folder)
        row = {"step": step_no}
        for domain, tokens in data.items():
            row[domain] = heldout_loss(model, tokens, seq_len, config.eval_batch, eos)[0]
        history.append(row)
        log(f"cpt held-out loss at step {step_no}: " + ", ".join(f"{d} {row[d]:.4f}" for d in data))
    rows = forgetting_flags(history, config.forgetting_threshold)
    first = next((r["step"] for r in rows if r["forgetting"]), None)
    (out / "history.json").write_text(json.dumps(rows, indent=2))
    if first is not None:
        log(
            f"FORGETTING: general held-out loss rose more than {config.forgetting_threshold:.0%} over the "
            f"base by step {first}; raise cpt.replay or lower cpt.lr_fraction"
        )
    return {
        "history": rows,
        "forgetting": first is not None,
        "first_forgetting_step": first,
        "threshold": config.forgetting_threshold,
        "domain_gain": rows[0].get("domain", 0) - rows[-1].get("domain", 0) if "domain" in data else None,
    }
