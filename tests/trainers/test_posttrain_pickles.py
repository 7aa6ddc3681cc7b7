"""Post-training resumes only from checkpoints whose pickles cannot run code: a DCP `.metadata`
inside a TRL checkpoint (FSDP SHARDED_STATE_DICT, which accelerate reads with plain pickle) is
checked with the pretraining checkpoints' allow-list unpickler first; a crafted one, planted from
outside with a matching manifest, makes resume fall back to the older checkpoint and runs nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from infra import manifest
from tests.model.test_checkpoint import PLANT
from trainers.posttrain.common import CHECKPOINTS, publish_checkpoint, refused_pickles, resume_point


def _trl_checkpoint(tmp_path, step):
    """A TRL checkpoint as FSDP's sharded state dict leaves it: a DCP folder plus trainer files."""
    src = tmp_path / f"checkpoint-{step}"
    dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(src / "pytorch_model_fsdp_0"), no_dist=True)
    (src / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return src


def test_a_crafted_dcp_metadata_in_a_trl_checkpoint_is_never_resumed(tmp_path):
    out = tmp_path / "sft"
    for step in (1, 2):
        publish_checkpoint(_trl_checkpoint(tmp_path, step), out / CHECKPOINTS, step, False, keep=3)
    newest = out / CHECKPOINTS / "step_00000002"
    assert refused_pickles(newest) == []  # what DCP writes passes
    canary = tmp_path / "pwned"
    metadata = newest / "pytorch_model_fsdp_0" / ".metadata"
    subprocess.run([sys.executable, "-c", PLANT.format(), str(canary), str(metadata), "popen_via_metadata"], check=True)
    record = json.loads((newest / manifest.MARKER).read_text())
    rel = "pytorch_model_fsdp_0/.metadata"
    record["files"][rel] = manifest.entries(newest, [rel])[rel]
    (newest / manifest.MARKER).write_text(json.dumps(record))
    assert manifest.verify(newest, names=sorted(record["files"])) == []  # the digests were forged too

    lines: list[str] = []
    assert resume_point(out, lines.append) == out / CHECKPOINTS / "step_00000001"
    assert any(
        "step_00000002 cannot be trusted" in line
        and "pytorch_model_fsdp_0/.metadata" in line
        and "subprocess.Popen, which is not a DCP metadata type" in line
        for line in lines
    ), lines
    assert not canary.exists()


# A pickle whose load would run a command (REDUCE of os.system), saved the way torch saves; the
# planting process loads a control copy with weights_only=False first, proving the payload is live.
TORCH_PAYLOAD = """
import os, sys, torch
class Payload:
    def __init__(self, flag):
        self.flag = flag
    def __reduce__(self):
        return (os.system, ("touch " + self.flag,))
control, canary, *paths = sys.argv[1:]
torch.save({"python": Payload(control)}, control + ".pt")
torch.load(control + ".pt", weights_only=False)
for path in paths:
    torch.save({"python": Payload(canary), "state": Payload(canary)}, path)
"""


def test_a_crafted_trainer_checkpoint_file_is_refused_by_transformers_loaders(tmp_path):
    """The HF Trainer files a TRL resume reads (rng_state.pth, optimizer.pt, scheduler.pt), planted
    from outside with a command inside, reach transformers' own loaders (weights_only=True): each
    is refused and the command never runs."""
    import pickle

    import pytest
    from transformers import Trainer, TrainingArguments

    ckpt, canary = tmp_path / "checkpoint-1", tmp_path / "pwned"
    ckpt.mkdir()
    names = ("rng_state.pth", "optimizer.pt", "scheduler.pt")
    control = tmp_path / "control"
    subprocess.run(
        [sys.executable, "-c", TORCH_PAYLOAD, str(control), str(canary), *(str(ckpt / n) for n in names)], check=True
    )
    assert control.exists()  # the payload runs where pickle is trusted
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer._load_rng_state(str(ckpt))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer._load_optimizer_and_scheduler(str(ckpt))
    assert not canary.exists()
