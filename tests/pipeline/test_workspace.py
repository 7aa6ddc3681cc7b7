"""pipeline/workspace.py: where a workspace is (a documented base, never the current directory) and
which folders can never be one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.home import PROJECT_ROOT
from pipeline.workspace import (
    Workspace,
    WorkspaceError,
    resolve_workspace,
)


def test_relative_workspaces_resolve_against_the_base_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("SMOLLM3_HOME", raising=False)
    monkeypatch.chdir(tmp_path)  # a serve process started from anywhere
    assert resolve_workspace("workspace") == PROJECT_ROOT.resolve() / "workspace"
    home = tmp_path / "home"
    monkeypatch.setenv("SMOLLM3_HOME", str(home))
    assert Workspace.at("runs/a").path == home.resolve() / "runs" / "a"
    assert resolve_workspace(tmp_path / "abs") == (tmp_path / "abs").resolve()
    monkeypatch.setenv("SMOLLM3_HOME", "relative/home")
    with pytest.raises(WorkspaceError, match="must be an absolute path"):
        resolve_workspace("w")


@pytest.mark.parametrize(
    "root", ["/etc", "/etc/smollm3", "/usr/local/ws", "/proc/self", "/", "/tmp", "~", "/var/lib/ws", "/home"]
)
def test_system_and_top_level_folders_are_refused(root):
    with pytest.raises(WorkspaceError, match="system or top-level folder"):
        resolve_workspace(root)


def test_a_relative_path_may_not_climb_out_of_its_base(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLLM3_HOME", str(tmp_path / "a" / "b"))
    with pytest.raises(WorkspaceError, match=r"leads to .*, not below it; give an absolute path"):
        resolve_workspace("../../etc")
    with pytest.raises(WorkspaceError, match="not below it"):
        resolve_workspace(".")


def test_a_symlink_into_a_system_folder_is_refused(tmp_path):
    link = tmp_path / "ws"
    os.symlink("/etc", link)
    with pytest.raises(WorkspaceError, match="resolves to /etc"):
        Workspace.at(link)


def test_allowed_roots_confine_workspaces(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLLM3_WORKSPACE_ROOTS", f"{tmp_path / 'fsx'}:{tmp_path / 'scratch'}")
    assert resolve_workspace(tmp_path / "scratch" / "run1") == (tmp_path / "scratch" / "run1")
    with pytest.raises(WorkspaceError, match="outside the allowed roots"):
        resolve_workspace(tmp_path / "elsewhere")
    assert Path(tmp_path / "fsx").resolve() == resolve_workspace(tmp_path / "fsx")
