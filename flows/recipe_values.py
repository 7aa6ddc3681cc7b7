"""Recipe values that only make sense together or against the file system, checked when it loads.

Each section checks its own fields (bounds, patterns: infra/launchers/text.py for launch strings);
what needs two sections or a look at a path lives here, called by `Recipe`'s validator, so a bad
value fails before any step runs with the field named and nothing echoed:

- `training.min_lr` is at most every peak it ends: `training.optimizer.lr` and, for each
  long-context stage, `lr x lr_scale` (a schedule that ends above its peak runs backwards);
- `tokenizer.path` is a regular file, or a folder whose `tokenizer.json` is one, when it exists
  (`/dev/zero` or a FIFO there made the plan read forever while hashing it); a missing one is the
  tokenizer step's error, since a recipe must load where its files are not;
- `preflight.checkpoint_dir` is inside the workspace (a relative path that does not climb out),
  or an absolute folder that would be accepted as a workspace (`pipeline/workspace.py`: no system
  or top-level folder, inside `$SMOLLM3_WORKSPACE_ROOTS` when set): preflight writes its probe
  there, so `/etc` is refused as `workspace=/etc` is.
"""

from __future__ import annotations

import stat
from pathlib import Path, PurePosixPath
from typing import Any

Recipe = Any  # flows/recipe.py's Recipe, which calls these (imported here it would be a cycle)


def check_values(recipe: Recipe) -> None:
    """Raise ValueError naming the first field at fault (see the module docstring)."""
    check_lr_order(recipe)
    if recipe.tokenizer.path:
        check_regular_file(recipe.tokenizer.path, "tokenizer.path", inside="tokenizer.json")
    if recipe.preflight.checkpoint_dir:
        check_storage_folder(recipe.preflight.checkpoint_dir, "preflight.checkpoint_dir")


MAX_LR = 1.0  # AdamW at a peak above 1 diverges at once: a recipe asking for it is a typo (0x10)


def check_lr_order(recipe: Recipe) -> None:
    t = recipe.training
    if t.optimizer.lr > MAX_LR:
        raise ValueError(
            f"training.optimizer.lr ({t.optimizer.lr:g}) is above {MAX_LR:g}: AdamW diverges there; "
            "SmolLM3 trained at 2e-4"
        )
    if t.min_lr > t.optimizer.lr:
        raise ValueError(
            f"training.min_lr ({t.min_lr:g}) is above training.optimizer.lr ({t.optimizer.lr:g}): "
            "the schedule decays from the peak to min_lr; lower min_lr"
        )
    for st in recipe.stages:
        if st.kind != "pretrain" and t.min_lr > t.optimizer.lr * st.lr_scale:
            raise ValueError(
                f"training.min_lr ({t.min_lr:g}) is above the peak of stage {st.name} "
                f"(training.optimizer.lr x stages[{st.name}].lr_scale = {t.optimizer.lr * st.lr_scale:g}); "
                "lower min_lr or raise lr_scale"
            )


def check_regular_file(value: str, field: str, inside: str | None = None) -> None:
    """`value`, when it exists, is a regular file (after symlinks), or a folder whose `inside`
    file, when it exists, is one."""
    path = Path(value).expanduser()
    if path.is_dir() and inside:
        path, field = path / inside, f"{field} (its {inside})"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"{field}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{field}: must be a regular file, not a device, FIFO, socket or other special file")


def check_storage_folder(value: str, field: str) -> None:
    """A relative folder that stays inside the workspace, or an absolute one the workspace
    rules accept."""
    from pipeline.workspace import WorkspaceError, resolve_workspace

    path = PurePosixPath(value)
    if not Path(value).expanduser().is_absolute():
        if ".." in path.parts:
            raise ValueError(f"{field}: a relative folder is inside the workspace and must not climb out of it (..)")
        return
    try:
        resolve_workspace(Path(value).expanduser())
    except WorkspaceError:
        raise ValueError(
            f"{field}: an absolute folder must be one a workspace may be (no system or top-level "
            "folder, inside $SMOLLM3_WORKSPACE_ROOTS when set); give a folder inside the workspace "
            "or on training storage"
        ) from None
