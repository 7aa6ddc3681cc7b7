"""Storage checks: free disk for the retained checkpoints, checkpoint-folder throughput with fsync,
an S3 round trip, and a torch.distributed.checkpoint save/load of a tiny state dict.

A training run that dies at step 200k because the disk filled, or that spends a third of its time
writing checkpoints to a slow mount, is the failure these checks exist to catch up front.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from infra.preflight.core import Check, CheckContext, CheckResult, register


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def existing_parent(path: Path) -> Path:
    """The nearest folder of `path` that exists (the disk it will be created on)."""
    path = path.resolve()
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path("/")


@register
class DiskFree(Check):
    """Free space where checkpoints go, against retention x checkpoint size x headroom."""

    name, group, order = "disk_free", "storage", 70

    def run(self, ctx: CheckContext) -> CheckResult:
        f, c = ctx.facts, ctx.config
        folder = c.checkpoint_path(f)
        free = shutil.disk_usage(existing_parent(folder)).free
        size, keep = f.checkpoint_size, f.checkpoint_keep
        value = f"{human_bytes(free)} free at {folder}"
        if not size or not keep:
            return self.result(
                "skip",
                value,
                advice="facts give no checkpoint_keep and checkpoint_bytes (or params) to size the retention",
            )
        need = keep * size * c.disk_headroom
        threshold = f">= {human_bytes(need)} ({keep} x {human_bytes(size)} x {c.disk_headroom:g})"
        if free < need:
            return self.result(
                "fail",
                value,
                threshold,
                f"not enough space for {keep} retained checkpoints: free space, lower "
                "training.keep_last (checkpoints kept besides stage ends; facts.checkpoint_keep "
                "by hand), or point preflight.checkpoint_dir at a larger volume",
                metric=free,
            )
        return self.result("pass", value, threshold, metric=free)


def io_throughput(folder: Path, mib: int) -> tuple[float, float]:
    """(write MB/s including fsync, read MB/s after dropping the file from the page cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 << 20)
    blocks = max(1, (mib << 20) // len(block))
    path = folder / f".preflight-io-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    try:
        start = time.perf_counter()
        with open(path, "wb") as fh:
            for _ in range(blocks):
                fh.write(block)
                digest.update(block)
            fh.flush()
            os.fsync(fh.fileno())  # a checkpoint is only safe once it reached the device
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            # evict the clean pages so the read measures the device, not the page cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            check = hashlib.sha256()
            start = time.perf_counter()
            while chunk := os.read(fd, 4 << 20):
                check.update(chunk)
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
        if check.digest() != digest.digest():
            raise OSError(f"checkpoint probe {path} read back different bytes than were written")
    finally:
        path.unlink(missing_ok=True)
    nbytes = blocks * len(block)
    return nbytes / write_s / 1e6, nbytes / read_s / 1e6


@register
class CheckpointIO(Check):
    """Write (with fsync) and read throughput of the checkpoint folder."""

    name, group, order = "checkpoint_io", "storage", 71

    def run(self, ctx: CheckContext) -> CheckResult:
        c = ctx.config
        folder = c.checkpoint_path(ctx.facts)
        try:
            write, read = io_throughput(folder, c.io_probe_mib)
        except OSError as exc:
            return self.result("fail", "", "", f"checkpoint_dir {folder} is not writable: {exc}")
        value = f"write {write:.0f} MB/s (fsync), read {read:.0f} MB/s, {c.io_probe_mib} MiB probe"
        threshold = f"write >= {c.min_write_mbps:g}, read >= {c.min_read_mbps:g} MB/s"
        size = ctx.facts.checkpoint_size
        eta = f"; one {human_bytes(size)} checkpoint takes ~{size / (write * 1e6):.1f} s" if size else ""
        if write < c.min_write_mbps or read < c.min_read_mbps:
            return self.result(
                "warn",
                value,
                threshold,
                f"slow checkpoint storage{eta}: use local NVMe and upload asynchronously",
                metric=write,
            )
        return self.result("pass", value, threshold + eta, metric=write)


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://bucket/prefix."""
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"s3_uri {uri!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


@register
class S3RoundTrip(Check):
    """Upload, download, compare and delete one object under the configured S3 prefix."""

    name, group, order = "s3_roundtrip", "storage", 72

    def run(self, ctx: CheckContext) -> CheckResult:
        c = ctx.config
        if c.s3_uri is None:
            return self.skip("no s3_uri configured")
        import boto3

        bucket, prefix = split_s3(c.s3_uri)
        key = "/".join(p for p in (prefix, "_preflight", f"{uuid.uuid4().hex}.bin") if p)
        data = os.urandom(c.s3_probe_mib << 20)
        client = boto3.client("s3", endpoint_url=c.s3_endpoint_url)
        try:
            start = time.perf_counter()
            client.put_object(Bucket=bucket, Key=key, Body=data)
            up = time.perf_counter() - start
            start = time.perf_counter()
            back = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            down = time.perf_counter() - start
            client.delete_object(Bucket=bucket, Key=key)
        except Exception as exc:  # botocore errors: credentials, missing bucket, endpoint down
            return self.result(
                "fail",
                "",
                "",
                f"S3 round trip to {c.s3_uri} failed: {type(exc).__name__}: {exc}; check the "
                "bucket exists, the credentials (AWS_PROFILE / AWS_ACCESS_KEY_ID) and s3_endpoint_url",
            )
        if back != data:
            return self.result("fail", "", "", f"{c.s3_uri}: the object read back differs from the upload")
        mb = len(data) / 1e6
        value = f"up {mb / up:.1f} MB/s, down {mb / down:.1f} MB/s ({c.s3_probe_mib} MiB)"
        return self.result("pass", value, "object reads back identical", metric=mb / up)


@register
class DcpRoundTrip(Check):
    """torch.distributed.checkpoint saves and loads a tiny state dict in the checkpoint folder."""

    name, group, order = "dcp_roundtrip", "storage", 73

    def run(self, ctx: CheckContext) -> CheckResult:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        folder = ctx.config.checkpoint_path(ctx.facts)
        folder.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(0)
        state = {
            "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.arange(32.0)},
            "optim": {"exp_avg": torch.randn(64, 32, generator=gen)},
        }
        target = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items()}
        with tempfile.TemporaryDirectory(prefix=".preflight-dcp-", dir=folder) as tmp:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no process group: running single-process"
                start = time.perf_counter()
                dcp.save(state, checkpoint_id=tmp)
                dcp.load(target, checkpoint_id=tmp)
                seconds = time.perf_counter() - start
            files = sorted(p.name for p in Path(tmp).iterdir())
        same = all(torch.equal(state[k][n], target[k][n]) for k in state for n in state[k])
        value = f"saved and loaded {len(files)} files in {seconds * 1000:.0f} ms"
        if not same:
            return self.result(
                "fail",
                value,
                "tensors identical after load",
                f"torch.distributed.checkpoint round trip in {folder} changed tensors",
            )
        return self.result("pass", value, "tensors identical after load")
