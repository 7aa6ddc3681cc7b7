"""End-to-end tests of trainers/pretrain.py, run as real subprocesses (python -m / torchrun).

Covered: SIGKILL mid-stage then resume == uninterrupted run, bit for bit; world size changes
1 -> 2 (FSDP2 under torchrun) -> 1 continue the data stream exactly (skipping a truncated newest
checkpoint); the non-finite guard; next-stage init; result.json and metrics.jsonl contents; bf16
autocast and compiled blocks on CPU against fp32.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import Checkpointer, load_model, read_marker

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
}


def write_spec(path: Path, plan: Path, out: Path, **kw) -> Path:
    spec = {
        "mixture_plan": str(plan),
        "out_dir": str(out),
        "steps": 6,
        "global_batch": 4,
        "micro_batch": 2,
        "model_overrides": TINY,
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "decay_fraction": 0.34, "total_steps": 6},
        "checkpoint_interval": 2,
        "keep_last": 2,
        "num_threads": 1,
        "peak_flops": 1e12,  # far above this CPU: MFU is a fraction
    } | kw
    path.write_text(json.dumps(spec))
    return path


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_train(spec: Path, nproc: int | None = None, check: bool = True):
    if nproc is None:
        cmd = [sys.executable, "-m", "trainers.pretrain", str(spec)]
    else:
        # --standalone: the rendezvous binds port 0 itself (a port picked here and bound later
        # can be taken by another xdist worker's launch in between)
        cmd = [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "trainers.pretrain",
            str(spec),
        ]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(out: Path) -> list[dict]:
    """The curve file's lines: every metrics line of a short stage, with the per-source counts."""
    return [json.loads(line) for line in (out / "metrics.curve.jsonl").read_text().splitlines()]


def assert_same_weights(a: Path, b: Path, exact: bool = True) -> None:
    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    assert wa.keys() == wb.keys()
    for name in wa:
        if exact:
            assert torch.equal(wa[name], wb[name]), name
        else:
            torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def clean8(tmp_path_factory) -> Path:
    """An uninterrupted 8-step run on `plan_path`'s data (the plan's bytes are seeded): the
    reference of the kill and corrupt-checkpoint tests below, trained once for both. Their
    `xdist_group` sends them to one pytest-xdist worker, so it is trained once per suite."""
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("clean8")
    plan = write_two_source_plan(root / "shards")
    run_train(write_spec(root / "clean.json", plan, root / "clean", steps=8))
    return root / "clean"


@pytest.mark.slow
@pytest.mark.xdist_group("pretrain-clean8")
def test_sigkill_mid_stage_then_resume_is_bit_identical(plan_path, tmp_path, clean8):
    clean = clean8

    killed = tmp_path / "killed"
    spec = write_spec(tmp_path / "killed.json", plan_path, killed, steps=8, debug_step_sleep_s=0.5)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainers.pretrain", str(spec)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = killed / "checkpoints" / "step_00000004"
    deadline = time.time() + 120
    while read_marker(target) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "result.json").exists()
    assert read_marker(killed / "checkpoints" / "step_00000008") is None

    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a line cut by the kill must not break the resume

    run_train(spec)  # same spec, same out_dir: resumes from step 4
    result = json.loads((killed / "result.json").read_text())
    assert result["final_step"] == 8
    assert result["resumed_from"].endswith("step_00000004")
    assert_same_weights(clean, killed, exact=True)
    clean_metrics, resumed_metrics = metrics(clean), metrics(killed)
    assert [m["step"] for m in resumed_metrics] == list(range(1, 9))  # lost steps dropped
    assert [m["loss"] for m in resumed_metrics] == [m["loss"] for m in clean_metrics]
    assert result["tokens_per_source"] == json.loads((clean / "result.json").read_text())["tokens_per_source"]


@pytest.mark.slow
def test_world_size_changes_1_to_2_to_1_continue_the_same_data_stream(plan_path, tmp_path):
    """1 rank for 2 steps, a 2-rank FSDP2 torchrun for 2 more, then 1 rank again to the end."""
    reference = tmp_path / "reference"
    run_train(write_spec(tmp_path / "ref.json", plan_path, reference))
    ref_metrics = curve(reference)

    out = tmp_path / "run"
    run_train(write_spec(tmp_path / "a.json", plan_path, out, steps=2))
    two = run_train(write_spec(tmp_path / "b.json", plan_path, out, steps=4, checkpoint_interval=1), nproc=2)
    assert "world 2" in two.stderr
    # Rank 0 speaks for the stage: one line per step (resumed at 2), none from rank 1.
    assert [int(m) for m in re.findall(r" step (\d+)/4 \|", two.stderr)] == [3, 4]
    assert two.stderr.count(" done: 2 steps in ") == 1
    mid = json.loads((out / "result.json").read_text())
    assert mid["world_size"] == 2 and mid["final_step"] == 4
    assert mid["resumed_from"].endswith("step_00000002")
    for a, b in zip(curve(out), ref_metrics[:4], strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["tokens_per_source"] == b["tokens_per_source"]

    # Truncate the newest checkpoint: resume must skip it, warn, and take step 3 (2 ranks').
    shard = next((out / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    one = run_train(write_spec(tmp_path / "c.json", plan_path, out, steps=6))
    assert "step_00000004 fails verification" in one.stderr and "(truncated" in one.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 1 and result["final_step"] == 6
    assert result["resumed_from"].endswith("step_00000003")
    ref_result = json.loads((reference / "result.json").read_text())
    assert result["tokens_per_source"] == ref_result["tokens_per_source"]
    assert result["final_loss"] == pytest.approx(ref_result["final_loss"], rel=1e-5)
    assert_same_weights(reference, out, exact=False)
    state = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["loader"]["sequence"] == 6 * 4 and state["stage_end"]
    assert sum(state["tokens_per_source"].values()) == 6 * 4 * 32


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_and_keeps_the_good_checkpoint(plan_path, tmp_path):
    out = tmp_path / "run"
    run_train(write_spec(tmp_path / "good.json", plan_path, out, steps=2))
    good = out / "checkpoints" / "step_00000002"
    marker_before = (good / "_CHECKPOINT.json").read_text()
    # An infinite learning rate makes the weights inf after step 3, so step 4's loss is NaN.
    bad = write_spec(
        tmp_path / "bad.json",
        plan_path,
        out,
        steps=6,
        checkpoint_interval=100,
        optimizer={"lr": float("inf")},
    )
    proc = run_train(bad, check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "loss is nan at step 4" in proc.stderr
    assert [f.name for f in Checkpointer(out / "checkpoints").step_folders()] == ["step_00000002"]
    assert (good / "_CHECKPOINT.json").read_text() == marker_before and read_marker(good) is not None
    assert json.loads((out / "result.json").read_text())["final_step"] == 2


def test_non_finite_weights_are_never_checkpointed(plan_path, tmp_path):
    out = tmp_path / "run"
    spec = write_spec(
        tmp_path / "bad.json",
        plan_path,
        out,
        steps=3,
        checkpoint_interval=1,
        optimizer={"lr": float("inf")},
    )
    proc = run_train(spec, check=False)
    assert proc.returncode == 3
    assert "weights are not finite after step 1" in proc.stderr
    assert Checkpointer(out / "checkpoints").latest() is None


def test_metrics_and_result_files(plan_path, tmp_path):
    out = tmp_path / "run"
    proc = run_train(write_spec(tmp_path / "s.json", plan_path, out, steps=3, log_interval=1))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # A short stage's curve file has every line, with the per-source counts the metrics lines leave out.
    lines = curve(out)
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_source", "epochs_per_source")} for r in lines] == rows
    assert [sum(r["tokens_per_source"].values()) for r in lines] == [4 * 32, 2 * 4 * 32, 3 * 4 * 32]
    assert all(r["epochs_per_source"].keys() == r["tokens_per_source"].keys() for r in lines)
    for row in rows:
        assert "tokens_per_source" not in row and "epochs_per_source" not in row
        assert {
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "mfu",
            "mfu_peak_flops",
            "mfu_peak_source",
            "peak_memory_gib",
        } <= row.keys()
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"]
        assert row["mfu_peak_flops"] == 1e12 and row["mfu_peak_source"] == "declared (training.peak_flops)"
        assert row["peak_memory_gib"] is None  # CUDA allocations only
    assert rows[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup step 1 of 2
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "result.json").read_text())
    assert Path(result["checkpoint"]).name == "step_00000003"
    assert json.loads((Path(result["checkpoint"]) / "_CHECKPOINT.json").read_text())["stage_end"]
    assert sum(result["tokens_per_source"].values()) == 3 * 4 * 32

    # The stage folder exports straight to transformers (its newest complete checkpoint).
    from transformers import SmolLM3ForCausalLM

    from model.hf import export_hf

    hf = SmolLM3ForCausalLM.from_pretrained(export_hf(out, tmp_path / "hf")).eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        ours = load_model(result["checkpoint"])(ids).logits
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=0)


def test_the_host_waits_for_the_device_only_at_metrics_lines_and_saves(plan_path, tmp_path):
    """Two ranks, a metrics line every 4 steps, a save only at the end (step 12): counted from
    outside (tests/trainers/host_syncs.py patches `Tensor.item`, `Tensor.tolist`,
    `cuda.synchronize` and `all_gather`), no step reads a device value, and the loop reads its
    values, gathers the ranks' timings and asks about stop signals only at steps 4, 8 and 12
    (and at start-up, step 0). The optimizer's own `_get_value` reads its step counts, CPU tensors
    unless the optimizer is capturable (torch's design: no device synchronisation), and is not counted."""
    out = tmp_path / "run"
    spec = write_spec(tmp_path / "s.json", plan_path, out, steps=12, log_interval=4, checkpoint_interval=100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    helper = Path(__file__).with_name("host_syncs.py")
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(helper),
        str(spec),
        str(tmp_path / "calls"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in metrics(out)] == [4, 8, 12]
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"calls.{rank}").read_text())
        counted = [c for c in calls if c[3] != "torch/optim/optimizer.py:_get_value"]
        assert not [c for c in counted if c[2]], counted  # nothing inside a step
        assert {c[1] for c in counted} <= {0, 4, 8, 12}, counted
        assert [c[1] for c in counted if c[0] == "all_gather"] == [4, 8, 12]  # the timings, once a line
        assert not [c for c in counted if c[0] == "synchronize"]
        values = [c[1] for c in counted if c[3].endswith("trainers/pretrain.py:read")]
        assert values == [4, 8, 12], counted  # loss, gradient norm and faults: one read a line


STEP_LINE = re.compile(
    r"^(?P<stage>\S+) step (?P<step>\d+)/(?P<total>\d+) \| loss (?P<loss>[\d.]+) \| lr (?P<lr>\S+) \| "
    r"grad (?P<grad>[\d.]+) \| (?P<tps>[\d,]+) tok/s( \| MFU (?P<mfu>[\d.]+)%)? \| ETA (?P<eta>\S+)$"
)


def test_rank_0_logs_step_loss_lr_grad_throughput_mfu_and_eta_every_interval(plan_path, tmp_path):
    """Every `log_interval` steps and at the last one, a line the task log shows; its numbers
    are the metrics rows' (loss, LR, gradient norm); a start line names the MFU peak's source."""
    out = tmp_path / "run"
    proc = run_train(write_spec(tmp_path / "s.json", plan_path, out, steps=5, log_interval=2))
    lines = [STEP_LINE.match(line) for line in proc.stderr.splitlines()]
    steps = [m for m in lines if m]
    assert [int(m["step"]) for m in steps] == [2, 4, 5]  # every 2 steps, and the end
    assert {m["total"] for m in steps} == {"5"} and steps[-1]["eta"] == "0s"
    rows = {r["step"]: r for r in metrics(out)}
    assert sorted(rows) == [2, 4, 5]
    for m in steps:
        row = rows[int(m["step"])]
        assert float(m["loss"]) == pytest.approx(row["loss"], abs=1e-4)
        assert float(m["lr"]) == pytest.approx(row["lr"], rel=1e-2)
        assert float(m["grad"]) == pytest.approx(row["grad_norm"], abs=1e-3)
        assert int(m["tps"].replace(",", "")) > 0 and m["mfu"] is not None
    assert "MFU peak 1e+12 FLOP/s (declared (training.peak_flops))" in proc.stderr
    assert re.search(r"done: 5 steps in \S+ \| loss [\d.]+ \| [\d,]+ tok/s \| MFU [\d.]+% \(declared", proc.stderr)
    assert "INFO" not in proc.stderr  # no logging boilerplate in the task log


def test_a_peak_below_the_achieved_rate_is_called_wrong_instead_of_printing_mfu_over_100(plan_path, tmp_path):
    """A peak below what the stage computes would give MFU > 100%: no such figure is printed or
    recorded; the log says the peak is wrong (once, with both rates and the peak's source) and
    every metrics row carries the reason instead of a number."""
    out = tmp_path / "run"
    proc = run_train(write_spec(tmp_path / "s.json", plan_path, out, steps=3, peak_flops=1e3))
    rows = metrics(out)
    assert all(r["mfu"] is None for r in rows)
    assert all(r["mfu_invalid"].startswith("the peak is wrong: ") for r in rows)
    assert all("above the peak of 1e+03 FLOP/s (declared (training.peak_flops))" in r["mfu_invalid"] for r in rows)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1 and "MFU not reported: the peak is wrong" in warnings[0]
    assert not re.search(r"MFU \d", proc.stderr)  # no MFU figure anywhere in the log
    assert "MFU not reported (peak below the achieved rate)" in proc.stderr


def test_without_a_known_peak_mfu_is_not_reported_and_the_metrics_say_why(plan_path, tmp_path):
    """CPU, nothing declared, no calibration: no probe under load, no MFU, and the reason."""
    out = tmp_path / "run"
    proc = run_train(write_spec(tmp_path / "s.json", plan_path, out, steps=2, peak_flops=None))
    rows = metrics(out)
    assert all(r["mfu"] is None and r["mfu_peak_flops"] is None for r in rows)
    assert rows[0]["mfu_peak_source"].startswith("none: no datasheet peak for cpu float32")
    assert "run preflight on this host" in rows[0]["mfu_peak_source"]
    assert "MFU not reported" in proc.stderr


def test_mfu_against_this_hosts_preflight_calibration_stays_below_1(plan_path, tmp_path):
    """The peak preflight measures here (best burst of its fp32 matmul) is above what training
    achieves, so MFU against it is a fraction; the rows name the calibration."""
    from infra.preflight.compute import cpu_matmul_gflops
    from model.spec import PeakCalibration

    torch.set_num_threads(1)
    flops = cpu_matmul_gflops(1024, 1.0) * 1e9
    calibration = PeakCalibration(
        host=socket.gethostname(), device="cpu", dtype="float32", flops=flops, threads=1, source="test calibration"
    )
    out = tmp_path / "run"
    run_train(
        write_spec(
            tmp_path / "s.json", plan_path, out, steps=4, peak_flops=None, peak_calibration=calibration.model_dump()
        )
    )
    rows = metrics(out)
    assert all(0 < r["mfu"] < 1 for r in rows), [r["mfu"] for r in rows]
    assert {r["mfu_peak_source"] for r in rows} == {"test calibration"}
    assert {r["mfu_peak_flops"] for r in rows} == {flops}


@pytest.mark.slow
def test_bf16_autocast_and_compiled_blocks_train_close_to_fp32(plan_path, tmp_path):
    """Two optimizer steps (2 micro-batches each) per path, through `python -m trainers.pretrain`.

    Tolerances, on loss and gradient norm at each step: bf16 keeps 8 significant bits, so one
    rounding is up to 2^-9 (0.2%) relative; matmuls and softmax round a few times on the way to
    the loss, so 1% bounds them with room (measured: 1e-5 at step 1, 5e-4 at step 2). A compiled
    fp32 block differs from eager only by inductor's fused reduction order, float32 rounding
    (measured: 1e-7), so 1e-4.
    """
    # No NoPE layer: every block is the same graph, so the compiled run compiles exactly once.
    kw = dict(steps=2, checkpoint_interval=2, model_overrides=TINY | {"no_rope_interval": 0})
    runs = {}
    for name, extra in {
        "fp32": {"precision": "fp32"},
        "bf16": {"precision": "bf16"},
        "compiled": {"precision": "fp32", "compile_model": True},
    }.items():
        out = tmp_path / name
        proc = run_train(write_spec(tmp_path / f"{name}.json", plan_path, out, **kw, **extra))
        runs[name] = (proc.stderr, metrics(out))
    assert "bf16 autocast, eager" in runs["bf16"][0]
    assert "fp32, compiled blocks" in runs["compiled"][0]
    assert "torch.compile: 1 graphs compiled" in runs["compiled"][0]  # no recompile at step 2
    ref = runs["fp32"][1]
    for name, rel in (("bf16", 1e-2), ("compiled", 1e-4)):
        rows = runs[name][1]
        assert [r["step"] for r in rows] == [1, 2]
        for row, base in zip(rows, ref, strict=True):
            for key in ("loss", "grad_norm"):
                assert math.isfinite(row[key])
                assert row[key] == pytest.approx(base[key], rel=rel), (name, row["step"], key)
    # bf16 really ran: its numbers are not fp32's.
    assert [r["grad_norm"] for r in runs["bf16"][1]] != [r["grad_norm"] for r in ref]


def test_compile_model_auto_compiles_blocks_on_cuda_and_runs_eager_on_cpu(tmp_path):
    """`compile_model: auto` (the default) resolves by device: compiled on CUDA, eager on CPU,
    where eager stays the tests' oracle; true and false force it on either. The device is given
    to the resolution only (no GPU is needed to name one)."""
    from model.spec import TrainSpec
    from trainers.pretrain import compiles_blocks

    base = {"mixture_plan": "plan.json", "out_dir": str(tmp_path), "steps": 1, "global_batch": 1, "micro_batch": 1}
    spec = TrainSpec.from_dict(base)
    assert spec.compile_model == "auto" and spec.fused_qkv is False
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert compiles_blocks(spec.compile_model, cpu) is False
    assert compiles_blocks(spec.compile_model, cuda) is True
    for forced in (True, False):
        value = TrainSpec.from_dict({**base, "compile_model": forced}).compile_model
        assert compiles_blocks(value, cpu) is forced and compiles_blocks(value, cuda) is forced
    with pytest.raises(ValueError, match="spec.compile_model"):
        TrainSpec.from_dict({**base, "compile_model": "sometimes"})
    with pytest.raises(ValueError, match="spec.compile_model must be true, false or 'auto', got 'yes'"):
        compiles_blocks("yes", cuda)


def test_precision_is_validated_with_the_field_named(tmp_path):
    from model.parallel import mixed_precision
    from model.spec import TrainSpec
    from trainers.pretrain import autocast_for

    base = {"mixture_plan": "plan.json", "out_dir": str(tmp_path), "steps": 1, "global_batch": 1, "micro_batch": 1}
    with pytest.raises(ValueError, match="spec.precision: Input should be 'auto', 'bf16' or 'fp32'"):
        TrainSpec.from_dict({**base, "precision": "fp16"})
    auto = TrainSpec.from_dict(base)
    assert not isinstance(autocast_for(auto, torch.device("cpu")), torch.autocast)  # fp32 on CPU
    # GPU: no autocast; bf16 compute is FSDP2's policy, over fp32 master weights and reduction.
    assert not isinstance(autocast_for(auto, torch.device("cuda")), torch.autocast)
    policy = mixed_precision(torch.device("cuda"), auto.precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(torch.device("cuda"), "fp32") is None
    assert mixed_precision(torch.device("cpu"), "auto") is None
    bf16 = TrainSpec.from_dict({**base, "precision": "bf16"})
    assert autocast_for(bf16, torch.device("cpu")).fast_dtype == torch.bfloat16  # the CPU bf16 path


def _optimizer_step_count(folder: Path, tmp_path: Path) -> float:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=False)
    return float(state["optim"]["state"]["embed.weight"]["step"])


@pytest.mark.slow
@pytest.mark.parametrize("reset", [False, True])
def test_next_stage_from_a_checkpoint_with_context_extension(plan_path, tmp_path, reset):
    stage1 = tmp_path / "stage1"
    run_train(write_spec(tmp_path / "s1.json", plan_path, stage1, steps=2, schedule={"total_steps": 10}))
    stage2 = tmp_path / "stage2"
    spec = write_spec(
        tmp_path / "s2.json",
        plan_path,
        stage2,
        steps=2,
        seq_len=64,
        rope_theta=1e6,
        schedule={"warmup_steps": 0, "total_steps": 10},
        init_from=str(stage1),
        reset_optimizer=reset,
        reset_schedule=reset,
    )
    run_train(spec)
    end = stage2 / "checkpoints" / "step_00000002"
    config = json.loads((end / "model_config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["max_seq_len"] >= 64
    state = json.loads((end / "trainer_state.json").read_text())
    assert state["global_step"] == (2 if reset else 4)  # the schedule continued at 2, or restarted
    assert state["loader"]["seq_len"] == 64 and state["loader"]["sequence"] == 2 * 4
    assert _optimizer_step_count(end, tmp_path) == (2.0 if reset else 4.0)
    result = json.loads((stage2 / "result.json").read_text())
    assert result["resumed_from"].endswith("stage1/checkpoints/step_00000002")
    assert sum(result["tokens_per_source"].values()) == 2 * 4 * 64


@pytest.mark.slow
def test_the_spec_seed_initialises_the_model(plan_path, tmp_path):
    """The recipe seed reaches initialisation through TrainSpec.seed: the same seed gives the same
    weights after the same steps, another seed other weights."""
    outs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        outs[name] = tmp_path / name
        run_train(
            write_spec(
                tmp_path / f"{name}.json",
                plan_path,
                outs[name],
                steps=1,
                seed=seed,
                checkpoint_interval=1,
                schedule={"total_steps": 1},
            )
        )
    final = {k: Checkpointer(v / "checkpoints").latest() for k, v in outs.items()}
    assert_same_weights(final["a"], final["b"])
    wa, wc = load_model(final["a"]).state_dict(), load_model(final["c"]).state_dict()
    assert not torch.equal(wa["embed.weight"], wc["embed.weight"])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_one_trainer_per_stage_folder_and_no_rank_outlives_torchrun(plan_path, tmp_path):
    """A second trainer in a live stage folder refuses to start, naming the holder; a SIGKILLed
    torchrun takes its rank along (the rank is in a session of its own); the next trainer takes
    over the dead holder's lease and resumes, and metrics.jsonl keeps one row per step."""
    out = tmp_path / "stage"
    spec = write_spec(
        tmp_path / "spec.json",
        plan_path,
        out,
        steps=12,
        debug_step_sleep_s=3,
        checkpoint_interval=2,
        schedule={"warmup_steps": 2, "total_steps": 12},
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = subprocess.Popen(
        [str(TORCHRUN), "--nproc-per-node", "1", "--master-port", str(port), "-m", "trainers.pretrain", str(spec)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rank = None
    try:
        deadline = time.time() + 120
        while read_marker(out / "checkpoints" / "step_00000002") is None and time.time() < deadline:
            assert first.poll() is None, "the first trainer ended early"
            time.sleep(0.05)
        rank = json.loads((out / ".lease.json").read_text())["holder"]["pid"]
        second = run_train(spec, check=False)
        assert second.returncode == 4, second.stderr[-2000:]
        assert f"LeaseHeld: stage folder {out} is in use by another trainer (pid {rank}" in second.stderr

        assert first.poll() is None and _alive(rank), "the first trainer ended before the test"
        os.kill(first.pid, signal.SIGKILL)  # torchrun alone, as `kill -9` of its group would
        first.wait()
        deadline = time.time() + 5
        while _alive(rank) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "the rank kept training after torchrun died"
    finally:
        first.kill()
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)

    assert metrics(out)[-1]["step"] < 12  # it really was killed mid-stage
    # the same stage without the per-step sleep: takes over the dead rank's lease, resumes
    run_train(
        write_spec(
            tmp_path / "spec.json",
            plan_path,
            out,
            steps=12,
            checkpoint_interval=2,
            schedule={"warmup_steps": 2, "total_steps": 12},
        )
    )
    result = json.loads((out / "result.json").read_text())
    assert result["final_step"] == 12 and result["resumed_from"] is not None
    assert [m["step"] for m in metrics(out)] == list(range(1, 13))
    assert not (out / ".lease.json").exists()  # released at the end


@pytest.mark.slow
@pytest.mark.xdist_group("pretrain-clean8")
def test_a_corrupt_newest_checkpoint_is_skipped_and_the_resume_matches_a_clean_run(plan_path, tmp_path, clean8):
    """Bytes flipped in the newest checkpoint's shard (same size): the old size-only check
    resumed from it and died later with NaN; now the trainer resumes from the previous one."""
    clean = clean8
    out = tmp_path / "damaged"
    run_train(write_spec(tmp_path / "six.json", plan_path, out, steps=6, keep_last=3))
    shard = next((out / "checkpoints" / "step_00000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))

    proc = run_train(write_spec(tmp_path / "eight.json", plan_path, out, steps=8, keep_last=3))
    assert "step_00000006 fails verification" in proc.stderr
    assert "content differs from the manifest" in proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["resumed_from"].endswith("step_00000004") and result["final_step"] == 8
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(clean)]
    assert_same_weights(clean, out, exact=True)


@pytest.mark.parametrize("doc_masking", [True, False])
def test_doc_masking_option_decides_what_the_first_step_attends_to(plan_path, tmp_path, doc_masking):
    """`spec.doc_masking` is what the trainer trains with: its first-step loss equals the loss of
    the same initial model on the same batches with document ids (masking) or without (plain
    causal attention over the packed sequence), and differs from the other."""
    from model.model import SmolLM3
    from model.spec import TrainSpec
    from model.token_shards import MixtureLoader, MixturePlan
    from trainers.pretrain import build_model_config

    out = tmp_path / "run"
    spec_file = write_spec(
        tmp_path / "spec.json",
        plan_path,
        out,
        steps=1,
        doc_masking=doc_masking,
        checkpoint_interval=1,
        schedule={"total_steps": 1},
    )
    run_train(spec_file)
    logged = metrics(out)[0]["loss"]
    spec = TrainSpec.load(spec_file)
    plan = MixturePlan.load(plan_path)
    cfg = build_model_config(spec, plan, plan.seq_len)
    model = SmolLM3(cfg).eval()
    model.init_weights(seed=spec.seed)
    loader = MixtureLoader(plan, seq_len=plan.seq_len, rank=0, world_size=1, vocab_size=cfg.vocab_size)
    batches = [loader.next_batch(spec.micro_batch) for _ in range(spec.global_batch // spec.micro_batch)]
    with torch.no_grad():
        masked = sum(model(b.input_ids, b.doc_ids, b.labels).loss.item() for b in batches) / len(batches)
        causal = sum(model(b.input_ids, None, b.labels).loss.item() for b in batches) / len(batches)
    assert abs(masked - causal) > 1e-4  # the batches hold several documents per row
    assert logged == pytest.approx(masked if doc_masking else causal, abs=1e-5)


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_launched_directly_the_trainer_refuses_a_stage_over_its_memory(plan_path, tmp_path, mode):
    """`python -m trainers.pretrain spec.json` (as a cluster job runs it) checks the spec's
    layout against `gpu_memory_gb` before allocating, with the recipe check's message: no
    warning-and-train, and "auto" that finds no fitting mode refuses instead of picking `full`."""
    out = tmp_path / mode
    spec = write_spec(tmp_path / "spec.json", plan_path, out, gpu_memory_gb=0.001, activation_checkpointing=mode)
    proc = run_train(spec, check=False)
    assert proc.returncode != 0
    expected = "does not fit the spec's gpu_memory_gb 0.001 GB: predicted peak"
    assert "DoesNotFit" in proc.stderr and expected in proc.stderr
    # auto tried every mode: the refusal is about the lightest one, full
    assert f"activation checkpointing {'full' if mode == 'auto' else 'none'} on" in proc.stderr
    assert "no single change of checkpointing, micro-batch or tp fits" in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_a_pull_failing_on_the_network_exits_6_which_the_step_retries(plan_path, tmp_path):
    """A cluster launch's rank 0 whose checkpoint pull cannot reach S3 (nothing listens on the
    endpoint) exits 6, naming the failure; the launcher reads exit 6 as external, so the step's
    retry runs the stage again instead of failing it as a code error."""
    from infra.launchers.base import EXIT_TRANSIENT, FailureFacts, LaunchFailed
    from infra.transient import transient
    from trainers.rank_signals import EXIT_TRANSIENT as TRAINER_EXIT_TRANSIENT

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = {"s3_uri": "s3://ckpts/run", "endpoint_url": f"http://127.0.0.1:{port}", "attempts": 1}
    mirror = {"uri": "s3://ckpts/run/pretrain/x/checkpoints", "storage": storage, "pull": True}
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "s.json", plan_path, out, mirror=mirror)
    # credentials are there (a missing one is a config error, not transient); the network is not
    env = _env() | {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    cmd = [sys.executable, "-m", "trainers.pretrain", str(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == EXIT_TRANSIENT == TRAINER_EXIT_TRANSIENT, proc.stderr[-2000:]
    assert "error: TransientFailure: checkpoint pull from s3://ckpts/run/pretrain/x/checkpoints failed" in proc.stderr
    assert not (out / ".pulled").exists()  # the waiting ranks would not pass
    facts = FailureFacts(rank=0, exitcode=proc.returncode, error="TransientFailure: checkpoint pull failed")
    assert facts.external and transient(LaunchFailed("stage1", facts=facts))
    assert "rank 0 failed on S3 or the network" in facts.cause()
    assert not transient(LaunchFailed("stage1", facts=FailureFacts(rank=0, exitcode=1, error="ValueError: x")))


def test_a_waiting_rank_outlasts_a_slow_pull_and_stops_at_a_stalled_one(tmp_path):
    """Rank 1 of a cluster launch waits for rank 0's pull for as long as bytes arrive, longer than
    its stall bound in all (here 1 s: twice the watchdog's 0.5 s startup bound), and fails as
    transient once nothing arrives for that long."""
    import threading
    from types import SimpleNamespace

    from infra.storage import MirrorTarget, StorageConfig
    from model.spec import TrainSpec, WatchdogConfig
    from trainers.pretrain import pull_mirror
    from trainers.rank_signals import TransientFailure

    mirror = MirrorTarget(uri="s3://ckpts/x", storage=StorageConfig(s3_uri="s3://ckpts"), pull=True)
    spec = TrainSpec(steps=1, out_dir=str(tmp_path), mirror=mirror, watchdog=WatchdogConfig(startup_s=0.5))
    partial = tmp_path / "checkpoints" / ".step_00000010.partial"
    partial.mkdir(parents=True)

    def slow_pull() -> None:  # 3 s in all, a chunk every 0.1 s, then the marker
        for _ in range(30):
            with open(partial / "model.distcp", "ab") as fh:
                fh.write(b"x" * 1000)
            time.sleep(0.1)
        (tmp_path / ".pulled").write_text("1")

    writer = threading.Thread(target=slow_pull)
    started = time.monotonic()
    writer.start()
    pull_mirror(spec, SimpleNamespace(rank=1))
    writer.join()
    assert time.monotonic() - started >= 2.9  # it waited for the whole pull, past its 1 s stall bound

    (tmp_path / ".pulled").unlink()  # the next launch's pull, which stalls
    with pytest.raises(TransientFailure, match=r"moved no byte in 1 s \(it has 1 files, 0.0 MB there\)"):
        pull_mirror(spec, SimpleNamespace(rank=1))
