"""The pin step (tasks/pin.py): a resolved base checkpoint pinned by hard links, so pruning the
original does not matter (the resolution itself: tests/model/test_base_checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

from model.base_checkpoint import resolve_base
from tasks.pin import PinSpec, pin


def test_pin_links_the_checkpoint_so_pruning_the_original_does_not_matter(run_ws, tmp_path):
    import shutil

    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws)
    out = tmp_path / "pin"
    (folders["stage2"] / "checkpoints" / "step_00000003" / "model_config.json").write_text("{}")
    base = resolve_base(ws.lineage(), ws)
    meta = pin(PinSpec.of(base), out=out)
    pinned = Path(meta["checkpoint"])
    # Same filesystem: pinned by hard links, so a multi-GB checkpoint costs no copy.
    assert (pinned / "trainer_state.json").stat().st_nlink == 2
    shutil.rmtree(base.checkpoint)  # the main run's retention deletes it
    from model.checkpoint import read_marker

    assert read_marker(pinned) is not None  # the pinned copy passes the checkpoint's manifest
    assert meta["global_step"] == 8 and meta["source"] == base.checkpoint
    assert json.loads((pinned / "trainer_state.json").read_text())["global_step"] == 8
