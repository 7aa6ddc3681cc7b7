"""Checkpoints: torch.distributed.checkpoint (DCP) folders with a verified completion marker.

Layout of one checkpoint, `{root}/step_{N:08d}/`:
    .metadata, __*_*.distcp   DCP: {"model": ..., "optim": ...} from `get_state_dict`, sharded
                              by FSDP2 and re-shardable to any world size on load
    model_config.json         ModelConfig, so the folder alone rebuilds the model (export)
    trainer_state.json        step, global step, schedule start, loss, data-loader state,
                              tokens drawn per source, world size, stage-end flag
    rng_rank{r}.pt            each rank's torch RNG states
    _CHECKPOINT.json                  written last, atomically (tmp file + os.replace): step, stage-end
                              flag and a manifest {file: {size, sha256}} (infra/manifest.py),
                              hashed by all ranks in parallel after the save.

A folder without a valid marker is incomplete. Listing and pruning only check sizes
(`read_marker`); anything that *trusts* a checkpoint (resume, next-stage init, export) verifies
every file's SHA-256 first (`verify_checkpoint`) and falls back to the newest checkpoint that
verifies, with a warning naming each file that failed (flipped bytes, a zeroed or missing
`.metadata`, a truncated shard).

Loading never unpickles arbitrary objects: DCP's `.metadata` is read with an unpickler whose
every global must be one of an exact table of DCP's metadata classes, torch sizes, dtypes and
layouts (by module and name, resolved without importing anything: `SafeFileSystemReader`); its
non-tensor items (optimizer hyperparameters) and the RNG files load with
`torch.load(weights_only=True)`. The digest check runs before any of it. See docs/architecture.md, "Threat model".

Retention keeps the newest `keep_last` complete checkpoints plus every stage end, and any that
the trainer's S3 uploader has not yet verified in the bucket (`protect`, infra/storage.py
`CheckpointUploader`; it is handed each folder as its marker is written: `on_complete`).

Asynchronous saves (`Checkpointer(async_save=True)`, the trainer's `spec.async_checkpoint`): DCP's
`async_save` copies this rank's shards to CPU memory (so the next optimizer step cannot change what
is written) and writes them from a background thread over a gloo group of its own, while training
goes on. The RNG files, `model_config.json` and `trainer_state.json` are written at once; the
marker only when every rank's write has finished: `poll()` (collective, once per step: one
integer all-reduce while a save is pending) completes it then, `wait()` blocks for it. Until its
marker exists the folder is incomplete, so a run killed meanwhile resumes from the checkpoint
before, exactly as after a crash during a synchronous save. A stage end is always saved
synchronously (the stage's result names it).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from infra import manifest
from infra.files import write_atomic
from model.config import ModelConfig
from model.model import SmolLM3

log = logging.getLogger(__name__)
MARKER = manifest.MARKER
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "model_config.json"


class CheckpointCorrupt(FileNotFoundError):
    """A checkpoint folder failed verification: no usable checkpoint there (a FileNotFoundError,
    so callers that handle a missing checkpoint handle this one too); the message lists why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint folder (sizes checked, not content), or None when it
    is incomplete or truncated. Cheap; `verify_checkpoint` before trusting the content."""
    return manifest.quick_check(Path(folder))


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _share(collective: bool, value: Any) -> list[Any]:
    """Every rank's `value` (all-gather) when collective under a process group, else [value]."""
    rank, world = _rank_world()
    if not collective or world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def verify_checkpoint(folder: str | Path, *, collective: bool = False) -> list[str]:
    """What is wrong with a checkpoint's files (empty: every size and SHA-256 matches).

    `collective=True` (every rank calls it) splits the hashing over the ranks: each reads
    1/world of the files.
    """
    folder = Path(folder)
    record = manifest.read_record(folder)
    if record is None:
        return [f"{MARKER}: missing or unreadable (the save did not finish)"]
    names = sorted(record["files"])
    rank, world = _rank_world() if collective else (0, 1)
    found = manifest.verify(folder, names=names[rank::world])
    problems = sorted(p for part in _share(collective, found) for p in part)
    if not problems and manifest.legacy_files(record) and _is_main():
        log.warning("checkpoint %s was written before content digests: only its file sizes could be checked", folder)
    return problems


# Exactly the globals a DCP `.metadata` pickle of torch 2.13 refers to (a real one, disassembled
# with pickletools: the dataclasses below, `_StorageInfo`, `torch.Size`, dtypes, layouts by name
# and the checkpoint id's `PosixPath`), mapped to objects this module already holds. A name is
# looked up in this table by (module, name) as written in the pickle, never resolved through
# `importlib` or attribute paths: `metadata.torch.utils.collect_env.subprocess.Popen` reaches
# `subprocess.Popen` from an allowed module by attributes, which the parent's `find_class` would
# follow (and build before any type check could look at it).
_MD = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for `torch.serialization._get_layout`: torch's layouts by their printed name."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"checkpoint metadata names an unknown tensor layout {name!r}")
    return layouts[name]


def _metadata_globals() -> dict[tuple[str, str], Any]:
    from pathlib import PosixPath

    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    table: dict[tuple[str, str], Any] = {(_MD, name): getattr(md, name) for name in _METADATA_CLASSES}
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = _layout_by_name
    for module in ("pathlib", "pathlib._local"):  # the checkpoint id (Python 3.13 names the submodule)
        table[(module, "PosixPath")] = PosixPath
    table.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return table


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata objects and nothing else: every global the pickle names must be one of
    `_metadata_globals()` by its exact (module, name); anything else (os.system, a dotted path to
    subprocess.Popen through an allowed module, builtins.eval, ...) is refused before it is built.
    Persistent ids are refused by pickle's default `persistent_load`."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._globals = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type; "
                "refusing to load it (the file was not written by torch.distributed.checkpoint)"
            )
        return found


def _check_metadata(metadata: Any, path: Any) -> None:
    """The loaded object is DCP Metadata whose storage entries name files inside the checkpoint
    folder (a crafted `relative_path` of `../..` would make DCP read another file as tensor bytes)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata; refusing to load it")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or "/" in rel or rel in ("", ".", ".."):
            raise pickle.UnpicklingError(
                f"{path} has a storage entry {rel!r} that is not a file of the checkpoint folder; refusing to load it"
            )


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with `.metadata` loaded by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(f"{path}: {exc}") from None
        _check_metadata(metadata, path)
        # As FileSystemReader.read_metadata does after unpickling:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _safe_reader(folder: Path) -> SafeFileSystemReader:
    """A reader for `folder` whose metadata has been read once already, so that a refused pickle
    raises its own clear UnpicklingError here (DCP would wrap it into "metadata is None")."""
    reader = SafeFileSystemReader(str(folder))
    reader.read_metadata()
    return reader


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class Checkpointer:
    """Saves, finds, loads and prunes the checkpoints under `root`."""

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 2,
        *,
        async_save: bool = False,
        on_complete: Callable[[Path], None] | None = None,
        protect: Callable[[], Collection[str]] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        # Rank 0, once a checkpoint's marker is written (the trainer's S3 uploader queues it), and
        # the names prune must keep besides its own rule (those still waiting for their upload).
        self.on_complete = on_complete
        self.protect = protect
        self._pending: tuple[Path, Any, int, bool] | None = None  # folder, future, step, stage end
        self._groups: tuple[Any, Any] | None = None  # gloo groups: the writer thread's, poll()'s

    def _async_groups(self) -> tuple[Any, Any]:
        """Two gloo groups (collective to create, so made by every rank at its first async save):
        one for DCP's writer thread, one for poll() in the training thread; neither shares the
        training collectives' group (NCCL on GPU, which async_save cannot use)."""
        if self._groups is None:
            self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        return self._groups

    def step_folders(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())

    def latest(self) -> Path | None:
        """Newest complete checkpoint by the cheap size check; newer incomplete ones are skipped
        with a warning. Use `latest_verified` before trusting its content."""
        for folder in reversed(self.step_folders()):
            if read_marker(folder) is not None:
                return folder
            log.warning(
                "checkpoint %s is incomplete or truncated (no valid %s marker); skipping it",
                folder,
                MARKER,
            )
        return None

    def latest_verified(self, *, collective: bool = False) -> Path | None:
        """Newest checkpoint whose every file matches its manifest's SHA-256.

        Each newer checkpoint that fails is skipped with a warning naming the files and what is
        wrong with them. `collective=True`: every rank calls it, rank 0's listing is used by all
        and the hashing is shared out.
        """
        names = [[f.name for f in self.step_folders()] if _is_main() else None]
        if collective and dist.is_initialized():
            dist.broadcast_object_list(names, src=0)
        for name in reversed(names[0]):
            folder = self.root / name
            problems = verify_checkpoint(folder, collective=collective)
            if not problems:
                return folder
            if _is_main():
                log.warning(
                    "checkpoint %s fails verification, so it is skipped and an older one is used: %s",
                    folder,
                    "; ".join(problems),
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
        """Collective: every rank calls it. Returns the folder: complete, unless this is a
        background save (async_save and not a stage end), which `poll()` or `wait()` completes."""
        self.wait()  # one save at a time: the previous background one gets its marker first
        folder = self.root / step_dir_name(step)
        if _is_main():
            if folder.exists():  # a leftover of a killed run at this very step
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        background = self.async_save and not stage_end and dist.is_initialized()
        if background:
            future = dcp.async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=str(folder),
                process_group=self._async_groups()[0],
            )
        else:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, folder / f"rng_rank{rank}.pt")
        if _is_main():
            config = model.config.to_dict()
            write_atomic(folder / MODEL_CONFIG, json.dumps(config, indent=2))
            state = dict(trainer_state, step=step, stage_end=stage_end)
            write_atomic(folder / TRAINER_STATE, json.dumps(state, indent=2))
        if background:
            self._pending = (folder, future, step, stage_end)
            return folder
        self._complete(folder, step, stage_end)
        return folder

    def poll(self) -> Path | None:
        """Collective: complete a background save if every rank's write has finished; its folder
        when it did, else None (nothing pending: no collective at all)."""
        if self._pending is None:
            return None
        done = torch.tensor([1 if self._pending[1].done() else 0], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._async_groups()[1])
        return self.wait() if done.item() else None

    def wait(self) -> Path | None:
        """Collective: block until a background save is written, then complete it (its folder)."""
        if self._pending is None:
            return None
        folder, future, step, stage_end = self._pending
        self._pending = None
        future.result()  # raises what the writer thread raised
        self._complete(folder, step, stage_end)
        return folder

    def _complete(self, folder: Path, step: int, stage_end: bool) -> None:
        """Every file is written: hash them (shared out) and write the marker (rank 0), then prune."""
        _barrier()
        # Every rank hashes a share of the files (rank 0's listing); rank 0 writes the marker.
        names = [manifest.payload_files(folder) if _is_main() else None]
        if dist.is_initialized():
            dist.broadcast_object_list(names, src=0)
        rank, world = _rank_world()
        hashed = _share(True, manifest.entries(folder, names[0][rank::world]))
        if _is_main():
            files = {k: v for part in hashed for k, v in part.items()}
            record = manifest.marker_record(step, stage_end, dict(sorted(files.items())))
            write_atomic(folder / MARKER, json.dumps(record, indent=2))
            if self.on_complete is not None:
                self.on_complete(folder)
            self.prune()
        _barrier()

    def prune(self) -> None:
        """Keep the newest keep_last complete checkpoints, every stage end, those `protect` names
        (waiting for their upload), nothing older."""
        complete = [(f, m) for f in self.step_folders() if (m := read_marker(f)) is not None]
        if not complete:
            return
        keep = {f for f, _ in complete[-self.keep_last :]} | {f for f, m in complete if m["stage_end"]}
        if self.protect is not None:
            keep |= {self.root / name for name in self.protect()}
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
        *,
        verified: bool = False,
    ) -> dict[str, Any]:
        """Collective: load model (and optimizer) state from `folder` into the (sharded) model.

        The folder is verified first (every rank hashes a share) unless the caller just did
        (`verified=True`, e.g. after `latest_verified`). The DCP planner reshards, so the world
        size may differ from the one that saved it. Returns the trainer state.
        """
        folder = Path(folder)
        if not verified:
            problems = verify_checkpoint(folder, collective=True)
            if problems:
                raise CheckpointCorrupt(f"checkpoint {folder} fails verification: " + "; ".join(problems))
        reader, planner = _safe_reader(folder), SafeLoadPlanner()
        if optimizer is None:
            model_sd = get_model_state_dict(model)
            dcp.load({"model": model_sd}, storage_reader=reader, planner=planner)
            set_model_state_dict(model, model_sd)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, storage_reader=reader, planner=planner)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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


def resolve_checkpoint(path: str | Path, *, collective: bool = False) -> Path:
    """A verified step folder from a step folder, a checkpoints root or a stage folder.

    A step folder given directly must verify (else `CheckpointCorrupt`); under a root, the newest
    checkpoint that verifies is taken, skipping newer ones that do not (with a warning).
    `collective=True` when every rank calls it (the trainer): the hashing is shared out.
    """
    path = Path(path)
    if (path / MARKER).exists():
        problems = verify_checkpoint(path, collective=collective)
        if problems:
            raise CheckpointCorrupt(f"checkpoint {path} fails verification: " + "; ".join(problems))
        return path
    for root in (path / "checkpoints", path):
        found = Checkpointer(root).latest_verified(collective=collective)
        if found is not None:
            return found
    raise FileNotFoundError(f"no complete, verified checkpoint at or under {path}")


def load_model(path: str | Path) -> SmolLM3:
    """Our full (unsharded) model from a verified checkpoint, in one process, no process group."""
    folder = resolve_checkpoint(path)
    cfg = ModelConfig.from_dict(json.loads((folder / MODEL_CONFIG).read_text()))
    model = SmolLM3(cfg)
    sd = model.state_dict()
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, storage_reader=_safe_reader(folder), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()
