"""Pinning a continuation's base checkpoint: the `pin` step.

Anneals and continued pretraining start from a checkpoint another run wrote; the flow resolves
it when the run starts (model/base_checkpoint.py `resolve_base`, a `BaseCheckpoint`), and `pin`
hard-links the checkpoint into its own folder (copies across filesystems), or converts an HF
folder into a model-only checkpoint, so the main run's retention (`keep_last`) may delete the
original while the continuation trains.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from model.base_checkpoint import BaseCheckpoint, link_or_copy, write_model_checkpoint
from pipeline.artifact import operational
from pipeline.step import step


class PinSpec(BaseModel):
    """The `pin` step's config. Its identity is the weights (`digest`, `kind`); where they are and
    the facts recorded with them are operational, so the same checkpoint found by another path,
    or the context of the run around it changing, does not pin (and retrain from) it again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str  # identity of the weights (manifest hash, or the HF weights' names/sizes/times)
    kind: Literal["checkpoint", "hf"] = "checkpoint"
    checkpoint: str = operational("")  # where they are now
    stage: str = operational("")  # facts recorded in the pin's meta
    step: int = operational(0)
    global_step: int = operational(0)
    lr: float = operational(0.0)
    run_id: str | None = operational(None)

    @classmethod
    def of(cls, base: BaseCheckpoint) -> PinSpec:
        """What the `pin` step needs of a resolved base: which weights (identity: the digest),
        and where they are."""
        return cls(
            checkpoint=base.checkpoint,
            kind=base.kind,
            digest=base.digest,
            stage=base.stage,
            step=base.step,
            global_step=base.global_step,
            lr=base.lr,
            run_id=base.run_id,
        )


@step("pin", version=2, kind="checkpoint", resource="eval", isolate=True)
def pin(config: PinSpec, *, out: Path, log=print) -> dict[str, Any]:
    """Pin a resolved base checkpoint (no inputs: the base is the config) as
    `out/checkpoint/step_N` (hard links or copies, verified against the checkpoint's manifest),
    or import an HF base as a model-only checkpoint."""
    from model.checkpoint import MODEL_CONFIG, read_marker

    source = Path(config.checkpoint)
    if config.kind == "hf":
        from model.hf import import_hf

        target = out / "checkpoint" / "step_00000000"
        write_model_checkpoint(import_hf(source), target)
        log(f"imported HF model {source} into {target}")
    else:
        target = out / "checkpoint" / source.name
        try:
            shutil.copytree(source, target, copy_function=link_or_copy)
        except (OSError, shutil.Error) as err:
            raise RuntimeError(
                f"could not copy base checkpoint {source} (pruned by the main run's retention while "
                f"copying?): {err}; rerun to resolve a newer one"
            ) from None
        if read_marker(target) is None:
            raise RuntimeError(f"the copy of base checkpoint {source} fails its manifest; rerun")
        log(
            f"pinned {config.stage} step {config.step} (global step {config.global_step}, lr {config.lr:.3g}) "
            f"from {source} to {target}"
        )
    return {
        "checkpoint": str(target),
        "source": str(source),
        "stage": config.stage,
        "step": config.step,
        "global_step": config.global_step,
        "lr": config.lr,
        "run_id": config.run_id,
        "digest": config.digest,
        "base_kind": config.kind,
        "model_config": json.loads((target / MODEL_CONFIG).read_text()),
    }
