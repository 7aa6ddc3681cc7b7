"""infra/home.py: a recipe's relative paths (workspace, `files:` globs, `hf:` folders) are taken
from $SMOLLM3_HOME, else the project root, never from the current directory."""

from __future__ import annotations

import json

import pytest

from curation.source_kinds import SourceConfig, check_sources, missing_sources, resolve_kind
from infra.home import PROJECT_ROOT, from_base, project_base


def _files(uri: str) -> SourceConfig:
    return SourceConfig(name="s", uri=uri, domain="web")


def test_a_relative_glob_means_the_same_files_from_any_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "b.jsonl").write_text(json.dumps({"text": "not this one"}) + "\n")
    monkeypatch.setenv("SMOLLM3_HOME", str(home))
    for cwd in (elsewhere, tmp_path):
        monkeypatch.chdir(cwd)
        kind = resolve_kind("files:data/*.jsonl")(_files("files:data/*.jsonl"), 0)
        assert kind._paths() == [home / "data" / "a.jsonl"]
        assert check_sources([_files("files:data/*.jsonl")]) == []
    # a glob matching nothing names where it was looked for: the base, not the current directory
    (why,) = missing_sources([_files("files:nothing/*.jsonl")]).values()
    assert f"no files match 'nothing/*.jsonl' (taken from {home.resolve()}: $SMOLLM3_HOME" in why
    assert str(elsewhere) not in why and str(tmp_path) + ")" not in why


def test_without_smollm3_home_the_base_is_the_project_root(tmp_path, monkeypatch):
    monkeypatch.delenv("SMOLLM3_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert project_base() == PROJECT_ROOT
    assert from_base("configs/tiny.yaml") == PROJECT_ROOT / "configs" / "tiny.yaml"
    assert from_base(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv("SMOLLM3_HOME", "relative")
    with pytest.raises(ValueError, match="SMOLLM3_HOME='relative' must be an absolute path"):
        project_base()


def test_a_relative_hf_folder_is_taken_from_the_base_too(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "saved").mkdir(parents=True)
    monkeypatch.setenv("SMOLLM3_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    # a folder under the base is local data (checked: it is no save_to_disk folder) ...
    (problem,) = check_sources([_files("hf:saved")])
    assert problem == f"sources[s].uri: {home / 'saved'} holds no dataset_info.json; is it a save_to_disk folder?"
    # ... and a folder in the current directory alone is not: it is a hub name, unchecked offline
    (tmp_path / "only-here").mkdir()
    assert check_sources([_files("hf:only-here")]) == []
