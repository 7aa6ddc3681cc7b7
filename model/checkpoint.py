"""Checkpoints: torch.distributed.checkpoint (DCP) folders with a completion marker.

Layout of one checkpoint, `{root}/step_{N:08d}/`:
    .metadata, __*_*.distcp   DCP: {"model": ..., "optim": ...} from `get_state_dict`, sharded
                              by FSDP2 and re-shardable to any world size on load
    model_config.json         ModelConfig, so the folder alone rebuilds the model (export)
    trainer_state.json        step, global step, schedule start, loss, data-loader state,
                              tokens drawn per source, world size, stage-end flag
    rng_rank{r}.pt            each rank's torch RNG states
    COMPLETE                  written last, atomically (tmp file + os.replace): step, stage-end
                              flag and a manifest {file: size}. A folder without it, or whose
                              files no longer match the manifest (truncated), is incomplete.

Retention keeps the newest `keep_last` complete checkpoints plus every stage end. Resume takes
the newest complete one and warns, naming each newer incomplete folder it skips.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from model.config import ModelConfig
from model.model import SmolLM3

log = logging.getLogger(__name__)
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "model_config.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")
    }


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint folder, or None when it is incomplete or truncated."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError):
        return None
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return marker


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves, finds, loads and prunes the checkpoints under `root`."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def step_folders(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())

    def latest(self) -> Path | None:
        """Newest complete checkpoint; newer incomplete ones are skipped with a warning."""
        for folder in reversed(self.step_folders()):
            if read_marker(folder) is not None:
                return folder
            log.warning(
                "checkpoint %s is incomplete or truncated (no valid %s marker); skipping it",
                folder,
                MARKER,
            )
        return None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        stage_end: bool = False,
    ) -> Path:
        """Collective: every rank calls it. Returns the complete folder."""
        folder = self.root / step_dir_name(step)
        if _is_main():
            if folder.exists():  # a leftover of a killed run at this very step
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, folder / f"rng_rank{rank}.pt")
        if _is_main():
            config = model.config.to_dict()
            atomic_write_text(folder / MODEL_CONFIG, json.dumps(config, indent=2))
            state = dict(trainer_state, step=step, stage_end=stage_end)
            atomic_write_text(folder / TRAINER_STATE, json.dumps(state, indent=2))
        _barrier()
        if _is_main():
            marker = {"step": step, "stage_end": stage_end, "files": _manifest(folder)}
            atomic_write_text(folder / MARKER, json.dumps(marker, indent=2))
            self.prune()
        _barrier()
        return folder

    def prune(self) -> None:
        """Keep the newest keep_last complete checkpoints, every stage end, nothing older."""
        complete = [(f, m) for f in self.step_folders() if (m := read_marker(f)) is not None]
        if not complete:
            return
        keep = {f for f, _ in complete[-self.keep_last :]} | {
            f for f, m in complete if m["stage_end"]
        }
        newest = complete[-1][0]
        for folder in self.step_folders():
            # Incomplete folders newer than the newest complete one may still be being written.
            if folder not in keep and folder.name < newest.name:
                shutil.rmtree(folder, ignore_errors=True)

    def load(
        self,
        folder: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Collective: load model (and optimizer) state from `folder` into the (sharded) model.

        The DCP planner reshards, so the world size may differ from the one that saved it.
        Returns the trainer state.
        """
        folder = Path(folder)
        if read_marker(folder) is None:
            raise FileNotFoundError(f"checkpoint {folder} is incomplete or truncated")
        if optimizer is None:
            model_sd = get_model_state_dict(model)
            dcp.load({"model": model_sd}, checkpoint_id=str(folder))
            set_model_state_dict(model, model_sd)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(folder))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng_file = folder / f"rng_rank{rank}.pt"
        if not rng_file.exists():  # resumed on more ranks than saved: take rank 0's
            rng_file = folder / "rng_rank0.pt"
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return read_trainer_state(folder)


def read_trainer_state(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / TRAINER_STATE).read_text())


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete step folder from a step folder, a checkpoints root or a stage folder."""
    path = Path(path)
    if (path / MARKER).exists():
        if read_marker(path) is None:
            raise FileNotFoundError(f"checkpoint {path} is truncated: its files fail the manifest")
        return path
    for root in (path / "checkpoints", path):
        found = Checkpointer(root).latest()
        if found is not None:
            return found
    raise FileNotFoundError(f"no complete checkpoint at or under {path}")


def load_model(path: str | Path) -> SmolLM3:
    """Our full (unsharded) model from a checkpoint, in one process, without a process group."""
    folder = resolve_checkpoint(path)
    cfg = ModelConfig.from_dict(json.loads((folder / MODEL_CONFIG).read_text()))
    model = SmolLM3(cfg)
    sd = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()
