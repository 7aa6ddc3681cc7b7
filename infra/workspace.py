"""The workspace: one folder holding every step output, the lineage database and Prefect state.

Layout (`{root}` defaults to `./workspace`, set by the recipe's `workspace` field):

    {root}/{step}/{fingerprint[:12]}/   step outputs, each finished when its marker exists
    {root}/lineage.duckdb               lineage (runs, steps, artifacts, edges, metrics, evals)
    {root}/results/                     Prefect's persisted task results (the cross-run cache)
    {root}/runs/{flow_run_id}/          the resolved recipe of every flow run
    {root}/prefect/                     PREFECT_HOME of the embedded server (SQLite database)
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from infra.lineage import Lineage
from infra.storage import StorageConfig


class Workspace(BaseModel):
    """Paths of one workspace; cheap to pass to tasks (it hashes by its root)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str
    # Where finished step folders are mirrored (the recipe's `storage`); None keeps them local.
    storage: StorageConfig | None = None

    @classmethod
    def at(cls, root: str | Path, storage: StorageConfig | None = None) -> Workspace:
        return cls(root=str(Path(root).expanduser().resolve()), storage=storage)

    @property
    def path(self) -> Path:
        return Path(self.root)

    @property
    def lineage_path(self) -> Path:
        return self.path / "lineage.duckdb"

    def lineage(self) -> Lineage:
        return Lineage(self.lineage_path)

    @property
    def results_dir(self) -> Path:
        return self.path / "results"

    def run_dir(self, run_id: str) -> Path:
        return self.path / "runs" / run_id

    @property
    def prefect_home(self) -> Path:
        return self.path / "prefect"
