"""The workspace: one folder holding every step output, the lineage database and Prefect state.

Where it is (`resolve_workspace`), the same whichever process asks (the CLI, the serve process
started from any directory, a worker):
- an absolute `workspace` is used as given;
- a relative one is resolved against `$SMOLLM3_HOME` when set, else the project root (the checkout
  holding `flows/`), never against the current directory; it must stay inside that base
  (`../../etc` is refused: give an absolute path to go elsewhere);
- system folders are refused, and so is anything under them (`/etc`, `/usr`, `/proc`, `/boot`,
  `/var/lib`, ...), as are bare top-level folders and homes (`/`, `/tmp`, `/home`, `~`): step
  folders are created and deleted under the workspace;
- with `$SMOLLM3_WORKSPACE_ROOTS` set (paths separated by `:`), the workspace must be inside one.
Symlinks are resolved first, so a link into /etc is refused too.

Layout (`{root}` defaults to `workspace` under the base, set by the recipe's `workspace` field):

    {root}/{step}/{fingerprint[:12]}/   step outputs, each finished when its marker exists
    {root}/lineage.duckdb               lineage (runs, steps, artifacts, edges, metrics, evals)
    {root}/results/                     Prefect's persisted task results (the cross-run cache)
    {root}/runs/{flow_run_id}/          the resolved recipe of every flow run
    {root}/prefect/                     PREFECT_HOME of the embedded server (SQLite database)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from infra.home import HOME_ENV, project_base
from infra.storage import StorageConfig
from infra.terminal import printable

if TYPE_CHECKING:  # imported where used: resolving a workspace needs no DuckDB
    from pipeline.lineage import Lineage

# A run id as it may name a file or folder (`runs/{id}/`, `reports/{id}.md`): Prefect's are UUIDs.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
ROOTS_ENV = "SMOLLM3_WORKSPACE_ROOTS"
# Neither these nor anything under them can hold a workspace.
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib",
    "/var/log",
    "/var/run",
    "/var/cache",
    "/var/spool",
    "/var/mail",
    "/snap",
    "/System",
    "/Library",
    "/private/etc",
)
# These themselves cannot (their subfolders can).
BARE_FOLDERS = (
    "/",
    "/home",
    "/tmp",
    "/var",
    "/var/tmp",
    "/opt",
    "/mnt",
    "/srv",
    "/media",
    "/root",
    "/Users",
    "/private",
    "/private/tmp",
)


class WorkspaceError(ValueError):
    """A workspace path that cannot be used; the message says why and what to give instead."""


def workspace_base() -> Path:
    """What a relative workspace is resolved against: $SMOLLM3_HOME, else the project root."""
    try:
        return project_base()
    except ValueError as exc:
        raise WorkspaceError(str(exc)) from None


def resolve_workspace(root: str | Path) -> Path:
    """The absolute, checked folder a recipe's `workspace` names (see the module docstring)."""
    raw = Path(root).expanduser()
    if str(root).strip() == "":
        raise WorkspaceError("workspace is empty; give a folder (e.g. workspace: runs/smollm3)")
    if raw.is_absolute():
        path = raw.resolve()
    else:
        base = workspace_base()
        path = (base / raw).resolve()
        if not path.is_relative_to(base.resolve()) or path == base.resolve():
            raise WorkspaceError(
                f"workspace {str(root)!r} is relative, so it is resolved against {base} "
                f"(${HOME_ENV}, else the project root), but it leads to {path}, not below it; "
                "give an absolute path to put the workspace elsewhere"
            )
    system = [t for t in SYSTEM_TREES if path == Path(t) or path.is_relative_to(t)]
    bare = {Path(b) for b in BARE_FOLDERS} | {Path.home().resolve()}
    if system or path in bare:
        raise WorkspaceError(
            f"workspace {str(root)!r} resolves to {path}, a system or top-level folder: step "
            "folders are created and deleted there. Use a folder of its own, e.g. "
            f"{workspace_base() / 'workspace'}"
        )
    roots = [Path(r).expanduser().resolve() for r in os.environ.get(ROOTS_ENV, "").split(":") if r]
    if roots and not any(path == r or path.is_relative_to(r) for r in roots):
        raise WorkspaceError(
            f"workspace {path} is outside the allowed roots ${ROOTS_ENV}="
            f"{':'.join(map(str, roots))}; move it under one of them or extend the list"
        )
    return path


class Workspace(BaseModel):
    """Paths of one workspace; cheap to pass to tasks (it hashes by its root)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str
    # Where finished step folders are mirrored (the recipe's `storage`); None keeps them local.
    storage: StorageConfig | None = None

    @classmethod
    def at(cls, root: str | Path, storage: StorageConfig | None = None) -> Workspace:
        """The workspace a recipe names, resolved and checked by `resolve_workspace`."""
        return cls(root=str(resolve_workspace(root)), storage=storage)

    @property
    def path(self) -> Path:
        return Path(self.root)

    @property
    def lineage_path(self) -> Path:
        return self.path / "lineage.duckdb"

    def lineage(self) -> Lineage:
        from pipeline.lineage import Lineage

        return Lineage(self.lineage_path)

    @property
    def results_dir(self) -> Path:
        return self.path / "results"

    def run_dir(self, run_id: str) -> Path:
        return self.path / "runs" / check_run_id(run_id)


def check_run_id(run_id: object, where: str = "lineage") -> str:
    """`run_id` when it can name a file (RUN_ID: letters, digits, `_` and `-`, at most 64, no
    `/`, `..` or absolute path); ValueError naming it (escaped) and where it came from."""
    if isinstance(run_id, str) and RUN_ID.fullmatch(run_id):
        return run_id
    raise ValueError(
        f"run id {printable(run_id)!r} from {where} is not a run id (letters, digits, _ and -, at most 64): "
        "refused before it names a file or folder"
    )
