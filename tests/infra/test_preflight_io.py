"""Preflight checks that touch the real machine: storage, S3 (moto), CPU matmul, gloo all-reduce."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.infra.test_storage import moto_reset

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

from infra.preflight import PreflightConfig, PreflightFacts, run_preflight  # noqa: E402
from infra.preflight.collective import bus_bandwidth  # noqa: E402


def run(checks, facts, **config):
    results = run_preflight(PreflightConfig(checks=tuple(checks), **config), facts, log=lambda _: None)
    return {r.name: r for r in results}


def test_disk_free_against_retention(tmp_path):
    ckpt = str(tmp_path / "ckpt" / "not-yet")  # need not exist: its disk is measured
    small = PreflightFacts(checkpoint_keep=3, checkpoint_bytes=1_000_000)
    assert run(["disk_free"], small, checkpoint_dir=ckpt)["disk_free"].status == "pass"
    huge = PreflightFacts(checkpoint_keep=5, params=10**15)  # 12 PB per checkpoint
    res = run(["disk_free"], huge, checkpoint_dir=ckpt)["disk_free"]
    assert res.status == "fail" and "checkpoint_keep" in res.advice
    assert run(["disk_free"], PreflightFacts(), checkpoint_dir=ckpt)["disk_free"].status == "skip"


def test_checkpoint_io_measures_and_cleans_up(tmp_path):
    res = run(
        ["checkpoint_io"],
        PreflightFacts(),
        checkpoint_dir=str(tmp_path),
        io_probe_mib=8,
        min_write_mbps=0,
        min_read_mbps=0,
    )["checkpoint_io"]
    assert res.status == "pass" and "MB/s" in res.value and res.metric > 0
    assert list(tmp_path.iterdir()) == []
    slow = run(["checkpoint_io"], PreflightFacts(), checkpoint_dir=str(tmp_path), io_probe_mib=4, min_write_mbps=1e9)[
        "checkpoint_io"
    ]
    assert slow.status == "warn"


def test_checkpoint_io_names_an_unwritable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = run(["checkpoint_io"], PreflightFacts(), checkpoint_dir=str(blocker / "ckpt"))["checkpoint_io"]
    assert res.status == "fail" and str(blocker / "ckpt") in res.advice


def test_dcp_roundtrip(tmp_path):
    res = run(["dcp_roundtrip"], PreflightFacts(workspace=str(tmp_path)))["dcp_roundtrip"]
    assert res.status == "pass", res.advice
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []


@pytest.fixture
def moto_s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 with fake credentials set only for this test."""
    import boto3
    from moto.server import ThreadedMotoServer

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    moto_reset(url)  # moto's state is process-global: start from an empty store
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="ckpts")
    yield url
    server.stop()


def test_s3_roundtrip_against_moto(moto_s3):
    import boto3

    r = run(["s3_roundtrip"], PreflightFacts(), s3_uri="s3://ckpts/runs/a", s3_endpoint_url=moto_s3, s3_probe_mib=1)
    assert r["s3_roundtrip"].status == "pass", r["s3_roundtrip"].advice
    assert "MB/s" in r["s3_roundtrip"].value
    left = boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket="ckpts")
    assert left.get("KeyCount", 0) == 0  # the probe object was deleted
    missing = run(
        ["s3_roundtrip"], PreflightFacts(), s3_uri="s3://nobucket/x", s3_endpoint_url=moto_s3, s3_probe_mib=1
    )["s3_roundtrip"]
    assert missing.status == "fail" and "s3://nobucket/x" in missing.advice


def test_s3_skips_without_uri():
    assert run(["s3_roundtrip"], PreflightFacts())["s3_roundtrip"].status == "skip"


def test_bus_bandwidth_formula():
    assert bus_bandwidth(10.0, 2) == 10.0
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert bus_bandwidth(10.0, 1) == 0.0


def test_cpu_report_gloo_allreduce_and_matmul_with_gpu_rows_skipped(tmp_path):
    """The CPU path of this machine: real gloo ranks under torchrun, small tensors."""
    checks = ["cpu_matmul", "gloo_allreduce", "gpu_matmul", "nccl_allreduce"]
    r = run(
        checks,
        PreflightFacts(workspace=str(tmp_path)),
        gloo_mib=1,
        collective_iters=3,
        cpu_matmul_size=256,
        cpu_matmul_seconds=0.2,
        collective_timeout_s=120,
    )
    assert r["gloo_allreduce"].status == "pass", r["gloo_allreduce"].advice
    assert r["gloo_allreduce"].metric > 0 and "GB/s busbw" in r["gloo_allreduce"].value
    assert r["cpu_matmul"].status == "pass" and r["cpu_matmul"].metric > 0
    import torch

    if not torch.cuda.is_available():  # on a GPU machine these rows measure instead
        assert r["gpu_matmul"].status == "skip" and "no CUDA" in r["gpu_matmul"].advice
        assert r["nccl_allreduce"].status == "skip"


def test_gloo_allreduce_skips_one_rank_per_node_unless_named():
    """A recipe of one rank per node (the tiny recipe) has no all-reduce between local ranks:
    the check skips without starting torchrun, unless `checks` names it (the test above)."""
    from infra.preflight.compute import GlooAllReduce
    from infra.preflight.core import CheckContext

    class NoCommands:
        def run(self, *args, **kwargs):
            raise AssertionError("started a command")

    def check(facts, **config):
        ctx = CheckContext(PreflightConfig(**config), facts, gpu=None, commands=NoCommands(), log=lambda _: None)
        return GlooAllReduce().run(ctx)

    res = check(PreflightFacts(nproc_per_node=1))
    assert res.status == "skip" and "one rank per node" in res.advice
    with pytest.raises(AssertionError, match="started a command"):  # named: it measures
        check(PreflightFacts(nproc_per_node=1), checks=("gloo_allreduce",))
    with pytest.raises(AssertionError, match="started a command"):  # two ranks per node: it measures
        check(PreflightFacts(nproc_per_node=2))
