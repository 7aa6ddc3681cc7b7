"""Capacity planner: the playbook's GPU count, Ultra-Scale memory figures, time from throughput."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

from infra.capacity import (  # noqa: E402
    activation_bytes_per_layer,
    format_plan,
    main,
    memory_per_gpu,
    parse_count,
    plan_gpus,
    plan_time,
    tflops_from_preflight,
)

PSI = 3e9


def test_playbook_gpu_count_for_smollm3():
    plan = plan_gpus(3e9, 11e12, days=28, tflops_per_gpu=720, mfu=0.30)
    assert plan.total_flops == pytest.approx(1.98e23)
    assert plan.effective_tflops == pytest.approx(216.0)
    assert 378 <= plan.gpus <= 380
    assert plan.gpus_needed == 379


def test_plan_gpus_names_bad_inputs():
    with pytest.raises(ValueError, match="mfu"):
        plan_gpus(3e9, 11e12, 28, 720, 30)
    with pytest.raises(ValueError, match="days"):
        plan_gpus(3e9, 11e12, 0, 720, 0.3)


def test_zero0_3b_needs_about_49_gb_of_model_state():
    m = memory_per_gpu(3.08e9, dp=192, zero=0)
    assert m.param_bytes == 2 * 3.08e9 and m.grad_bytes == 2 * 3.08e9
    assert m.optimizer_bytes == 12 * 3.08e9
    assert m.model_state_bytes / 1e9 == pytest.approx(49.3, abs=0.1)
    assert m.activation_bytes == 0  # no shapes given


@pytest.mark.parametrize(
    ("zero", "expected"),
    [(0, 16 * PSI), (1, 4 * PSI + 12 * PSI / 8), (2, 2 * PSI + 14 * PSI / 8), (3, 16 * PSI / 8)],
)
def test_zero_stages_follow_ultra_scale(zero, expected):
    assert memory_per_gpu(PSI, dp=8, zero=zero).model_state_bytes == pytest.approx(expected)


def test_fp32_grad_accumulation_adds_4_psi_and_tp_pp_divide_psi():
    assert memory_per_gpu(PSI, zero=0, fp32_grad_accum=True).model_state_bytes == pytest.approx(20 * PSI)
    assert memory_per_gpu(PSI, dp=8, zero=2, fp32_grad_accum=True).model_state_bytes == pytest.approx(
        2 * PSI + 18 * PSI / 8
    )
    assert memory_per_gpu(PSI, tp=2, pp=2).model_state_bytes == pytest.approx(4 * PSI)


def test_activation_formula_and_recompute():
    s, b, h, a = 4096, 1, 2048, 16
    none = activation_bytes_per_layer(s, b, h, a)
    assert none == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, tp=2) == none / 2
    assert activation_bytes_per_layer(s, b, h, a, recompute="selective") == s * b * h * 34
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    m = memory_per_gpu(PSI, seq=s, micro_batch=b, layers=36, hidden=h, heads=a)
    assert m.activation_bytes == pytest.approx(36 * none)
    # 1F1B: the first stage keeps pp micro-batches of layers/pp layers: no saving from pp
    assert memory_per_gpu(PSI, pp=4, seq=s, layers=36, hidden=h, heads=a).activation_bytes == pytest.approx(36 * none)
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(s, b, h, a, recompute="some")  # type: ignore[arg-type]


def test_time_from_measured_tokens_per_second_matches_smollm3():
    # 384 GPUs at ~14k tokens/s/GPU trained 11.1T tokens in about 24 days
    t = plan_time(3.08e9, 11.1e12, gpus=384, tokens_per_gpu_second=14_000)
    assert t.days == pytest.approx(23.9, abs=0.2)
    assert t.gpu_hours == pytest.approx(t.days * 24 * 384)
    via_flops = plan_time(3e9, 11e12, gpus=379, tflops_per_gpu=720, mfu=0.3)
    assert via_flops.days == pytest.approx(28, abs=0.1)


def test_tflops_from_preflight_takes_the_slowest_gpu(tmp_path):
    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"results": [{"name": "gpu_matmul", "metric": 701.5}]}))
    assert tflops_from_preflight(path) == 701.5
    path.write_text(json.dumps({"results": [{"name": "gpu_matmul", "status": "skip", "metric": None}]}))
    with pytest.raises(ValueError, match="gpu_matmul"):
        tflops_from_preflight(path)


def test_parse_count():
    assert parse_count("3B") == 3e9 and parse_count("11.1T") == 11.1e12 and parse_count("2e9") == 2e9
    with pytest.raises(ValueError, match="suffix"):
        parse_count("three billion")


def test_cli_prints_every_plan(capsys):
    assert (
        main(
            [
                "--params",
                "3B",
                "--tokens",
                "11T",
                "--days",
                "28",
                "--tflops",
                "720",
                "--mfu",
                "0.3",
                "--tp",
                "2",
                "--zero",
                "1",
                "--recompute",
                "selective",
                "--micro-batch",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "378.9 -> 379" in out and "ZeRO-1" in out and "recompute selective" in out
    assert "Assumed" not in out  # every figure the GPU count needs was given


def test_a_plan_from_params_alone_says_which_figures_it_assumed(capsys):
    assert main(["--params", "3e9"]) == 0
    out = capsys.readouterr().out
    head = out.split("GPUs")[0]
    assert "--tokens (took 11T)" in head and "--days (took 28)" in head and "--tflops or --preflight" in head
    assert "give your run's training tokens and deadline" in head
    assert "GPUs needed" in out and "Memory per GPU" in out
    main(["--params", "3e9", "--tokens", "1T", "--days", "14", "--tflops", "700"])
    assert "Assumed" not in capsys.readouterr().out


def test_format_plan_with_memory_only():
    text = format_plan(memory=memory_per_gpu(3.08e9))
    assert "model state    49.3 GB" in text and "GPUs" not in text
