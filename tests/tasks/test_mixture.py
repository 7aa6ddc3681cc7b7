"""The mixture steps: budgets, epochs, plan.json (the mixture files themselves: tests/curation/test_mixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from curation.mixtures import MixtureError, MixtureWarning
from pipeline.artifact import Artifact
from tasks.mixture import MixtureSpec, StageConfig, mixture


def _shards(tmp_path, name: str, tokens: int) -> Artifact:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / f"{name}_00000.ds").write_bytes(b"\0\0" * tokens)
    meta = {
        "source": name,
        "tokens": tokens,
        "files": [f"{name}_00000.ds"],
        "vocab_size": 4096,
        "eos_id": 0,
        "token_dtype": "uint16",
    }
    return Artifact(kind="shards", uri=str(folder), fingerprint=name.ljust(64, "0"), meta=meta)


def test_plan_budgets_epochs_and_contract(tmp_path):
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"prose": 0.9, "code": 0.45, "math": 0.15, "idle": 0}}))
    stage = StageConfig(name="stage1", mixture=str(mix), tokens=20_000, seq_len=256, max_epochs=4)
    shards = [_shards(tmp_path, n, t) for n, t in (("prose", 2000), ("code", 50_000), ("math", 1500), ("idle", 10))]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.warns(MixtureWarning) as caught:
        meta = mixture(MixtureSpec.of(stage, 7), shards, out=out)
    messages = [str(w.message) for w in caught]
    assert any("weights sum to 1.5, not 1; normalised" in m for m in messages)
    assert any("'prose' would repeat 6.0 times" in m for m in messages)
    assert not any("'code'" in m for m in messages)
    plan = json.loads((out / "plan.json").read_text())
    assert list(plan) == ["stage", "seed", "seq_len", "tokens", "vocab_size", "eos_id", "token_dtype", "sources"]
    assert (plan["stage"], plan["seed"], plan["seq_len"], plan["tokens"]) == ("stage1", 7, 256, 20_000)
    assert (plan["vocab_size"], plan["eos_id"], plan["token_dtype"]) == (4096, 0, "uint16")
    by_name = {s["name"]: s for s in plan["sources"]}
    assert set(by_name) == {"prose", "code", "math"}  # weight 0: left out
    assert list(by_name["prose"]) == ["name", "weight", "files", "available_tokens", "budget_tokens", "expected_epochs"]
    assert by_name["prose"]["weight"] == pytest.approx(0.6) and by_name["prose"]["budget_tokens"] == 12_000
    assert by_name["prose"]["expected_epochs"] == 6.0 and by_name["math"]["budget_tokens"] == 2000
    files = [f for s in plan["sources"] for f in s["files"]]  # relative to the plan, inside the workspace
    assert all(f.startswith("../") and (out / f).resolve().is_file() for f in files), files
    assert meta["original_weight_sum"] == 1.5 and meta["unused"] == ["idle"]


def test_plan_is_read_by_the_trainer_loader(tmp_path):
    data = pytest.importorskip("model.token_shards")
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 0.5, "b": 0.5}}))
    stage = StageConfig(name="stage2", mixture=str(mix), tokens=1000, seq_len=8)
    out = tmp_path / "out"
    out.mkdir()
    mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 600), _shards(tmp_path, "b", 600)], out=out)
    plan = data.MixturePlan.load(out / "plan.json")
    assert plan.stage == "stage2" and [s.name for s in plan.sources] == ["a", "b"]


def test_a_plan_moved_with_its_workspace_reads_the_shards_where_they_are_now(tmp_path):
    """The plan names its shards relative to itself: a copied workspace's plan, the original
    deleted, still loads for the trainer and the preflight with the copy's files."""
    import shutil

    from infra.preflight.data import load_plans
    from model.token_shards import MixturePlan

    ws = tmp_path / "ws"
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 0.5, "b": 0.5}}))
    stage = StageConfig(name="stage1", mixture=str(mix), tokens=1000, seq_len=8)
    out = ws / "mixture" / "abcdef123456"
    out.mkdir(parents=True)
    (ws / "tokenize").mkdir()
    mixture(MixtureSpec.of(stage, 0), [_shards(ws / "tokenize", "a", 600), _shards(ws / "tokenize", "b", 600)], out=out)
    moved = tmp_path / "bigger-disk" / "ws"
    shutil.copytree(ws, moved)
    shutil.rmtree(ws)
    plan = MixturePlan.load(moved / "mixture" / "abcdef123456" / "plan.json")
    files = [Path(f) for s in plan.sources for f in s.files]
    assert files == [moved / "tokenize" / n / f"{n}_00000.ds" for n in ("a", "b")]
    assert all(f.is_file() for f in files)
    (loaded,) = load_plans((str(moved / "mixture" / "abcdef123456" / "plan.json"),))
    assert [Path(f) for s in loaded["sources"] for f in s["files"]] == files


def test_plan_refuses_sources_without_shards_and_mixed_tokenizers(tmp_path):
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 1.0, "ghost": 1.0}}))
    stage = StageConfig(name="s", mixture=str(mix), tokens=10, seq_len=2)
    with pytest.raises(MixtureError, match="unknown source\\(s\\) ghost"):
        mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 100)], out=tmp_path)
    mix.write_text(yaml.safe_dump({"weights": {"a": 1.0, "b": 1.0}}))
    b = _shards(tmp_path, "b", 100)
    b = b.model_copy(update={"meta": {**b.meta, "vocab_size": 128256, "token_dtype": "uint32"}})
    with pytest.raises(MixtureError, match="shards disagree on vocab_size"):
        mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 100), b], out=tmp_path)
