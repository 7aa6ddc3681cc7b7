"""Tests for model/checkpoint.py: DCP save/load, completion markers, retention, truncation, and
damage done from outside (flipped bytes, zeroed or missing .metadata, truncated shards, a crafted
pickle): verified before trusted, fallback to the newest checkpoint that verifies."""

from __future__ import annotations

import json
import logging
import pickle
import re

import pytest
import torch
import torch.distributed as dist

from model.checkpoint import (
    CheckpointCorrupt,
    Checkpointer,
    load_model,
    read_marker,
    resolve_checkpoint,
    verify_checkpoint,
)
from model.model import SmolLM3
from model.optim import build_optimizer
from model.spec import OptimizerConfig


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(cfg, steps=1, seed=0):
    torch.manual_seed(seed)
    model = SmolLM3(cfg)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save_steps(ckpt, cfg, steps, stage_end=()):
    models = {}
    for step in steps:
        model, opt = _trained(cfg, seed=step)
        ckpt.save(step, model, opt, {"loader": {"sequence": step}}, stage_end=step in stage_end)
        models[step] = model
    return models


def test_save_then_load_restores_model_optimizer_and_state(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg, steps=2)
    folder = ckpt.save(7, model, opt, {"loader": {"sequence": 42}})
    assert folder.name == "step_00000007"
    marker = read_marker(folder)
    assert marker["step"] == 7 and "trainer_state.json" in marker["files"]

    fresh, fresh_opt = _trained(tiny_cfg, steps=0, seed=99)
    state = ckpt.load(folder, fresh, fresh_opt)
    assert state["loader"] == {"sequence": 42} and state["step"] == 7
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    saved_moments = opt.state_dict()["state"]
    loaded_moments = fresh_opt.state_dict()["state"]
    for idx, moments in saved_moments.items():
        assert torch.equal(loaded_moments[idx]["exp_avg_sq"], moments["exp_avg_sq"])
        assert float(loaded_moments[idx]["step"]) == 2.0


def test_truncated_or_unmarked_newest_is_skipped_with_a_warning(one_rank_group, tiny_cfg, tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=5)
    models = _save_steps(ckpt, tiny_cfg, [1, 2, 3])
    shard = next((ckpt.root / "step_00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated, marker intact
    (ckpt.root / "step_00000004").mkdir()  # a save killed before its marker
    with caplog.at_level(logging.WARNING, logger="model.checkpoint"):
        latest = ckpt.latest()
    assert latest.name == "step_00000002"
    assert "step_00000004" in caplog.text and "step_00000003" in caplog.text
    loaded = load_model(tmp_path / "ckpt")  # also what export uses, without a process group
    for name, tensor in models[2].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(FileNotFoundError, match="step_00000003"):
        resolve_checkpoint(ckpt.root / "step_00000003")


def test_retention_keeps_last_k_and_every_stage_end(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=2)
    _save_steps(ckpt, tiny_cfg, [1, 2, 3, 4, 5], stage_end={2})
    assert [f.name for f in ckpt.step_folders()] == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert json.loads((ckpt.root / "step_00000002" / "_CHECKPOINT.json").read_text())["stage_end"]


def test_a_leftover_folder_at_the_same_step_is_replaced(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    (ckpt.root / "step_00000003").mkdir(parents=True)
    (ckpt.root / "step_00000003" / "junk.distcp").write_bytes(b"x")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(3, model, opt, {})
    assert not (folder / "junk.distcp").exists() and read_marker(folder) is not None


# --- corruption from outside: the files on disk are changed after the save -------------------------


def _flip(path, offset: int = -1, count: int = 16) -> None:
    """Invert `count` bytes of a file in place (same size: a size check cannot see it)."""
    data = bytearray(path.read_bytes())
    start = offset if offset >= 0 else len(data) // 2
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("flip_shard", r"__0_0.distcp: content differs from the manifest"),
        ("zero_metadata", r"\.metadata: content differs from the manifest .*all zero bytes"),
        ("delete_metadata", r"\.metadata: missing"),
        ("truncate_shard", r"__0_0.distcp: \d+ bytes, the manifest says \d+ \(truncated"),
        ("flip_rng", r"rng_rank0.pt: content differs"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_naming_what_failed(
    one_rank_group, tiny_cfg, tmp_path, caplog, damage, expected
):
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=5)
    models = _save_steps(ckpt, tiny_cfg, [1, 2])
    newest = ckpt.root / "step_00000002"
    shard, meta = newest / "__0_0.distcp", newest / ".metadata"
    if damage == "flip_shard":
        _flip(shard)
    elif damage == "zero_metadata":
        meta.write_bytes(bytes(meta.stat().st_size))
    elif damage == "delete_metadata":
        meta.unlink()
    elif damage == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip_rng":
        _flip(newest / "rng_rank0.pt")

    problems = verify_checkpoint(newest)
    assert len(problems) == 1 and re.search(expected, problems[0]), problems
    with caplog.at_level(logging.WARNING, logger="model.checkpoint"):
        assert ckpt.latest_verified() == ckpt.root / "step_00000001"
    assert re.search(rf"step_00000002 fails verification.*{expected}", caplog.text)
    loaded = load_model(ckpt.root)  # export's path: also falls back
    for name, tensor in models[1].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(CheckpointCorrupt, match=expected):
        resolve_checkpoint(newest)  # named directly: refused, not silently replaced
    fresh, fresh_opt = _trained(tiny_cfg, steps=0, seed=9)
    with pytest.raises(CheckpointCorrupt, match=expected):
        ckpt.load(newest, fresh, fresh_opt)


# Crafted `.metadata` files, written by a separate process (the attacker) as raw pickle opcodes:
# each would run `touch CANARY` if the unpickler built what it names. `args` is the pickled
# argument tuple (protocol 2 opcodes, valid inside a protocol 4 stream).
PLANT = """
import pickle, sys
canary, path, kind = sys.argv[1:]
args = pickle.dumps((["touch", canary],), protocol=2)[2:-1]
sh = pickle.dumps(("touch " + canary,), protocol=2)[2:-1]
md = b"torch.distributed.checkpoint.metadata"
payloads = {{
    # a plain os.system GLOBAL
    "os_system": b"\\x80\\x04cos\\nsystem\\n" + sh + b"R.",
    # subprocess.Popen reached by attributes from DCP's own metadata module (GLOBAL, then REDUCE)
    "popen_via_metadata": b"\\x80\\x04c" + md + b"\\ntorch.utils.collect_env.subprocess.Popen\\n" + args + b"R.",
    # the same through STACK_GLOBAL, as protocol 4 writes globals
    "popen_stack_global": (
        b"\\x80\\x04\\x8c" + bytes([len(md)]) + md + b"\\x8c\\x28torch.utils.collect_env.subprocess.Popen\\x93"
        + args + b"R."
    ),
    # through `torch` itself, which allowed torch.Size and the dtypes
    "popen_via_torch": b"\\x80\\x04ctorch\\nutils.collect_env.subprocess.Popen\\n" + args + b"R.",
    # INST (protocol 0): find_class then a call, in one opcode
    "popen_inst": b"(" + pickle.dumps(["touch", canary], protocol=0)[:-1] + b"i" + md + b"\\ntorch.utils.collect_env.subprocess.Popen\\n.",
    # a type of the metadata module's namespace that is not a metadata class (Enum's functional API)
    "type_gadget": b"\\x80\\x04c" + md + b"\\nEnum\\n" + pickle.dumps(("X", "a b"), protocol=2)[2:-1] + b"R.",
}}
open(path, "wb").write(payloads[kind])
"""
_VIA_MD = "torch.distributed.checkpoint.metadata.torch.utils.collect_env.subprocess.Popen"
PAYLOADS = {  # kind: the global the error names
    "os_system": "os.system",
    "popen_via_metadata": _VIA_MD,
    "popen_stack_global": _VIA_MD,
    "popen_via_torch": "torch.utils.collect_env.subprocess.Popen",
    "popen_inst": _VIA_MD,
    "type_gadget": "torch.distributed.checkpoint.metadata.Enum",
}


def test_the_popen_gadget_is_real():
    """The dotted path the attack uses reaches subprocess.Popen through pickle's own resolution,
    so a test that finds the canary missing proves our unpickler refused it, not that it missed."""
    import io
    import subprocess

    import torch.distributed.checkpoint.metadata  # noqa: F401  (what loading a checkpoint imports)

    class Probe(pickle.Unpickler):
        pass

    probe = Probe(io.BytesIO(b"\x80\x04N."))  # protocol 4: dotted names resolve
    probe.load()
    found = probe.find_class("torch.distributed.checkpoint.metadata", "torch.utils.collect_env.subprocess.Popen")
    assert found is subprocess.Popen


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_a_crafted_metadata_with_a_matching_manifest_runs_nothing(one_rank_group, tiny_cfg, tmp_path, kind):
    """Someone who can write the folder replaces `.metadata` with a pickle that runs a command
    and rewrites _CHECKPOINT.json to match: the digest passes, the unpickler refuses the global
    before building anything, naming the file and the global."""
    import subprocess
    import sys

    from infra import manifest

    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(1, model, opt, {})
    canary = tmp_path / "pwned"
    subprocess.run([sys.executable, "-c", PLANT.format(), str(canary), str(folder / ".metadata"), kind], check=True)
    record = json.loads((folder / "_CHECKPOINT.json").read_text())
    record["files"][".metadata"] = manifest.entries(folder, [".metadata"])[".metadata"]
    (folder / "_CHECKPOINT.json").write_text(json.dumps(record))
    assert verify_checkpoint(folder) == []  # the forger kept the manifest consistent

    expected = (
        rf"\.metadata: checkpoint metadata refers to {re.escape(PAYLOADS[kind])}, which is not a DCP metadata type"
    )
    with pytest.raises(pickle.UnpicklingError, match=expected):
        load_model(folder)
    fresh, fresh_opt = _trained(tiny_cfg, steps=0, seed=9)
    with pytest.raises(pickle.UnpicklingError, match=expected):
        ckpt.load(folder, fresh, fresh_opt)
    assert not canary.exists()


def test_a_crafted_rng_file_with_a_matching_manifest_runs_nothing(one_rank_group, tiny_cfg, tmp_path):
    """The per-rank RNG state is a pickle too: one planted with an os.system REDUCE and a manifest
    rewritten to match is refused by torch.load(weights_only=True) before anything runs."""
    import subprocess
    import sys

    from infra import manifest

    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(1, model, opt, {})
    canary = tmp_path / "pwned"
    rng = folder / "rng_rank0.pt"
    subprocess.run([sys.executable, "-c", PLANT.format(), str(canary), str(rng), "os_system"], check=True)
    record = json.loads((folder / "_CHECKPOINT.json").read_text())
    record["files"][rng.name] = manifest.entries(folder, [rng.name])[rng.name]
    (folder / "_CHECKPOINT.json").write_text(json.dumps(record))
    assert verify_checkpoint(folder) == []
    fresh, fresh_opt = _trained(tiny_cfg, steps=0, seed=9)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckpt.load(folder, fresh, fresh_opt)
    assert not canary.exists()


def test_a_storage_entry_outside_the_folder_is_refused(one_rank_group, tiny_cfg, tmp_path):
    """A `.metadata` made only of allowed classes whose storage entry points at `../x`: refused
    before DCP reads another file as tensor bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from infra import manifest
    from model.checkpoint import SafeFileSystemReader

    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(1, model, opt, {})
    metadata = SafeFileSystemReader(str(folder)).read_metadata()
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first] = _StorageInfo("../outside.distcp", 0, 8)
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    record = json.loads((folder / "_CHECKPOINT.json").read_text())
    record["files"][".metadata"] = manifest.entries(folder, [".metadata"])[".metadata"]
    (folder / "_CHECKPOINT.json").write_text(json.dumps(record))
    with pytest.raises(pickle.UnpicklingError, match=r"storage entry '\.\./outside\.distcp' that is not a file"):
        load_model(folder)


def test_a_real_metadata_names_only_the_allowed_globals(one_rank_group, tiny_cfg, tmp_path):
    """Every global a DCP `.metadata` written by this torch names is in the table (so the table
    is what DCP writes, not a guess), and the table holds nothing DCP does not write beyond the
    dtypes, layouts and the other spelling of PosixPath."""
    from model.checkpoint import _metadata_globals

    class Recorder(pickle.Unpickler):
        seen: set = set()

        def find_class(self, module, name):
            self.seen.add((module, name))
            return super().find_class(module, name)

    folder = Checkpointer(tmp_path / "ckpt").save(1, *_trained(tiny_cfg), {})
    with open(folder / ".metadata", "rb") as fh:
        Recorder(fh).load()
    table = _metadata_globals()
    assert Recorder.seen <= set(table), Recorder.seen - set(table)
    extra = {k for k in set(table) - Recorder.seen if k[0] != "torch" and k != ("pathlib._local", "PosixPath")}
    assert extra == set(), extra


def test_a_checkpoint_from_before_digests_still_loads(one_rank_group, tiny_cfg, tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(1, model, opt, {})
    record = json.loads((folder / "_CHECKPOINT.json").read_text())
    legacy = {"step": 1, "stage_end": False, "files": {name: entry["size"] for name, entry in record["files"].items()}}
    (folder / "_CHECKPOINT.json").write_text(json.dumps(legacy))
    with caplog.at_level(logging.WARNING, logger="model.checkpoint"):
        loaded = load_model(folder)
    assert "written before content digests" in caplog.text
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_non_tensor_items_never_unpickle_code(tmp_path):
    """Optimizer hyperparameters are DCP 'bytes' items; DCP's default planner loads them with
    weights_only=False. Ours refuses anything but plain data."""
    import io
    import os

    from model.checkpoint import SafeLoadPlanner

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        SafeLoadPlanner().load_bytes(None, buf)
    assert not (tmp_path / "pwned").exists()
