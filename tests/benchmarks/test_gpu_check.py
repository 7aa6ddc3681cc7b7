"""Tests for benchmarks/gpu_check.py: its CPU smoke runs every code path that needs no CUDA.

The smoke is the real script as a subprocess (`--cpu-smoke`): the trainer with compiled blocks,
the transformers model, the flex-vs-dense comparison, the SIGKILL-and-resume, the memory rows
(every checkpointing mode, predicted against measured) and the loss rows, at toy size. So
the GPU check cannot rot between the rare runs on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
PREFLIGHT = ("gpu_count", "gpu_matmul", "gpu_throttle", "gpu_memory", "gpu_ecc", "dcgm_diag",
             "nccl_allreduce")  # fmt: skip
MEMORY = tuple(f"memory ckpt={m} T={t}" for t in (128, 256) for m in ("none", "selective", "full"))
RAN = ("train_ours", "train_transformers", "flex_fwd T=128", "flex_fwd T=100", "flex_fwd T=40",
       "resume_identical", *MEMORY, "loss chunked T=1024", "loss unfused T=1024")  # fmt: skip
CUDA_ONLY = ("ratio_vs_transformers", "flex_bwd T=128", "flex_bwd T=100", "flex_bwd T=40")


def _megabytes(value: str) -> float:
    """The peak of a loss row's value, `peak 3.4 MB (...)` or `peak 1.20 GB (...)`, in MB."""
    number, unit = value.split()[1:3]
    return float(number) * (1000 if unit == "GB" else 1)


@pytest.mark.slow
def test_cpu_smoke_exits_0_and_prints_every_row(tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path / "r.json"),
         "--out", str(tmp_path / "r.md")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["check", "status", "s", "value", "detail"]
    printed = {line.split("  ")[0].strip(): line for line in lines[2:-1]}
    assert set(printed) == set(PREFLIGHT + RAN + CUDA_ONLY)

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mode"] == "cpu-smoke"
    rows = {r["check"]: r for r in report["rows"]}
    for name in RAN:
        assert rows[name]["status"] == "PASS", rows[name]
        assert rows[name]["value"], name  # a measured value, not just a verdict
    for name in PREFLIGHT + CUDA_ONLY:
        assert rows[name]["status"] == "SKIP" and rows[name]["detail"], rows[name]  # named why
    assert "no backward on CPU" in rows["flex_bwd T=40"]["detail"]
    assert "tok/s" in rows["train_ours"]["value"] and "tok/s" in rows["train_transformers"]["value"]
    assert rows["resume_identical"]["value"].startswith("bit-identical weights")
    for name in MEMORY:  # measured against predicted, within the 15% the row judges
        assert rows[name]["value"].startswith("measured ") and "predicted " in rows[name]["value"], rows[name]
    chunked, unfused = (_megabytes(rows[f"loss {k} T=1024"]["value"]) for k in ("chunked", "unfused"))
    assert chunked < unfused  # the chunked loss never holds the whole logits
    assert lines[-1] == f"{len(RAN)} PASS, 0 FAIL, {len(PREFLIGHT + CUDA_ONLY)} SKIP"

    markdown = (tmp_path / "r.md").read_text()
    assert "| check | status | s | value | detail |" in markdown
    assert all(f"| {name} |" in markdown for name in rows)


def test_without_cuda_the_full_check_refuses_and_names_the_smoke():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the full check would run")
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device visible" in proc.stderr and "--cpu-smoke" in proc.stderr
