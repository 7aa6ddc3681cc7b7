"""Layouts of the trainer on CPU over gloo (model/parallel.py), as real torchrun launches.

- DP 2 x TP 2 (tensor + sequence parallelism, FSDP2 over the DP pairs) with fused QKV (one matmul
  on each rank's q, k, v shards) trains with the losses of DP 4's three matmuls within fp32
  tolerance; resumed from its own checkpoint it ends bit-identical to the uninterrupted run; its
  checkpoint loads at another layout (one plain rank, three matmuls) and trains on.
- HSDP over two torchrun "nodes" of two ranks (replicate 2 x shard 2) trains like DP 4.
- Activation checkpointing through the trainer, and "auto" choosing it from a declared memory;
  asynchronous checkpoint writes resume bit-identically.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest

from tests.trainers.test_pretrain import REPO, TORCHRUN, _env, assert_same_weights, metrics, run_train, write_spec

STEPS = dict(steps=4, global_batch=4, micro_batch=1, checkpoint_interval=2, keep_last=4)
STEPS["schedule"] = {"warmup_steps": 2, "decay_fraction": 0.34, "total_steps": 4}


def _losses(out):
    return [r["loss"] for r in metrics(out)]


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def _weights_close(a, b) -> None:
    """Weights of two layouts after a few AdamW steps: fp32 summation order moves gradients by
    ulps, and AdamW's normalisation (m / sqrt(v)) turns that into update differences for
    near-zero gradients; 1e-4 is under 1% of what 4 steps at lr 3e-3 move a weight."""
    import torch

    from model.checkpoint import load_model

    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-4, rtol=0, msg=name)


def _copy_checkpoint(src_out, step: int, dst_out) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(src_out / "checkpoints" / name, dst_out / "checkpoints" / name)


# One pytest-xdist worker runs this module, so its module fixtures (the DP 4 and one-rank reference runs) are built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("parallel-dp4")


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    """One DP 4 reference run (FSDP2 over 4 ranks), shared by the tests below."""
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("dp4")
    plan = write_two_source_plan(root / "shards")
    out = root / "dp4"
    run_train(write_spec(root / "dp4.json", plan, out, **STEPS), nproc=4)
    return plan, out


@pytest.mark.slow
def test_dp2_x_tp2_matches_dp4_resumes_bit_identically_and_loads_at_another_layout(dp4, tmp_path):
    plan, dp4_out = dp4
    tp = tmp_path / "tp"
    proc = run_train(write_spec(tmp_path / "tp.json", plan, tp, tp=2, fused_qkv=True, **STEPS), nproc=4)
    assert "fused QKV" in proc.stderr
    assert "world 4 (DP 2 x TP 2 (4 ranks)), accum 2" in proc.stderr
    assert "redistributing" not in proc.stderr  # the 2D-norm warning is silenced (trainer main)
    assert _close(_losses(tp), _losses(dp4_out)), (_losses(tp), _losses(dp4_out))
    _weights_close(tp, dp4_out)

    # The same layout, resumed from step 2 in a fresh folder: bit-identical to the uninterrupted run.
    again = tmp_path / "again"
    _copy_checkpoint(tp, 2, again)
    resumed = run_train(write_spec(tmp_path / "again.json", plan, again, tp=2, fused_qkv=True, **STEPS), nproc=4)
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert _losses(again) == _losses(tp)[2:]
    assert_same_weights(again, tp, exact=True)

    # Another layout: the TP checkpoint at step 2 continues on one plain rank.
    one = tmp_path / "one"
    _copy_checkpoint(tp, 2, one)
    run_train(write_spec(tmp_path / "one.json", plan, one, **STEPS))
    assert json.loads((one / "result.json").read_text())["resumed_from"].endswith("step_00000002")
    assert _close(_losses(one), _losses(tp)[2:])
    _weights_close(one, tp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(spec) -> list[tuple[str, str]]:
    """`spec` trained by two torchrun "nodes" of two ranks each on this machine (HSDP replicates
    across them); (stdout, stderr) of each node, both asserted to exit 0."""
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "trainers.pretrain",
                str(spec),
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    return outputs


@pytest.mark.slow
def test_hsdp_over_two_nodes_trains_like_dp4(dp4, tmp_path):
    plan, dp4_out = dp4
    out = tmp_path / "hsdp"
    outputs = run_two_nodes(write_spec(tmp_path / "hsdp.json", plan, out, hsdp=True, **STEPS))
    assert "world 4 (HSDP 2 x 2 (4 ranks))" in outputs[0][1]
    assert _close(_losses(out), _losses(dp4_out)), (_losses(out), _losses(dp4_out))
    _weights_close(out, dp4_out)


@pytest.fixture(scope="module")
def plain6(tmp_path_factory):
    """One rank, 6 steps, synchronous checkpoints every 2, no activation checkpointing: the
    reference of the checkpointing-modes and async-checkpoint tests, trained once for both; its
    folder and stderr."""
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("plain6")
    plan = write_two_source_plan(root / "shards")
    out = root / "plain"
    spec = write_spec(
        root / "plain.json", plan, out, steps=6, checkpoint_interval=2, keep_last=4, activation_checkpointing="none"
    )
    return out, run_train(spec).stderr


@pytest.mark.slow
def test_trainer_checkpointing_modes_are_bit_identical_and_auto_picks_what_fits(plan_path, tmp_path, plain6):
    from model.config import ModelConfig
    from model.memory import StepShape, estimate
    from tests.trainers.test_pretrain import TINY

    runs, stderr = {}, {}
    runs["none"], stderr["none"] = plain6  # write_spec's 6 steps; keep_last moves neither losses nor weights
    out = tmp_path / "full"
    runs["full"] = out
    stderr["full"] = run_train(
        write_spec(tmp_path / "full.json", plan_path, out, activation_checkpointing="full")
    ).stderr
    for mode in ("none", "full"):
        assert f"activation checkpointing {mode} (predicted peak" in stderr[mode]
    assert _losses(runs["full"]) == _losses(runs["none"])
    assert_same_weights(runs["full"], runs["none"], exact=True)

    # "auto" with a declared memory between what "full" and "selective" need: the trainer picks full.
    cfg = ModelConfig.tiny(vocab_size=128, **TINY)
    shape = StepShape(cfg, seq_len=32, micro_batch=2, accum=2, device="cpu", wrapped=False)
    between = (estimate(shape, "full").budget_gb() + estimate(shape, "selective").budget_gb()) / 2
    auto = tmp_path / "auto"
    proc = run_train(
        write_spec(tmp_path / "auto.json", plan_path, auto, activation_checkpointing="auto", gpu_memory_gb=between)
    )
    assert "activation checkpointing full (predicted peak" in proc.stderr
    assert json.loads((auto / "result.json").read_text())["activation_checkpointing"] == "full"


@pytest.mark.slow
def test_async_checkpoints_are_complete_and_resume_bit_identically(plan_path, tmp_path, plain6):
    (sync, _), background = plain6, tmp_path / "async"
    run_train(
        write_spec(
            tmp_path / "async.json", plan_path, background, steps=6, checkpoint_interval=2, keep_last=4,
            async_checkpoint=True,
        )
    )  # fmt: skip
    from model.checkpoint import Checkpointer, verify_checkpoint

    folders = Checkpointer(background / "checkpoints").step_folders()
    assert [f.name for f in folders] == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(verify_checkpoint(f) == [] for f in folders)  # every one got its marker
    assert _losses(background) == _losses(sync)
    assert_same_weights(background, sync, exact=True)

    resumed = tmp_path / "resumed"
    _copy_checkpoint(background, 4, resumed)
    spec = write_spec(
        tmp_path / "resumed.json", plan_path, resumed, steps=6, checkpoint_interval=2, keep_last=4,
        async_checkpoint=True,
    )  # fmt: skip
    run_train(spec)
    assert _losses(resumed) == _losses(sync)[4:]
    assert_same_weights(resumed, sync, exact=True)
