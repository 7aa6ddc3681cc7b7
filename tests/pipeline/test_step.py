"""Which step failures a retry can fix (pipeline.step.transient), and the retry policy of the steps."""

from __future__ import annotations

import errno

import pytest

from infra.launchers.base import FailureFacts, LaunchFailed
from infra.storage import StorageError
from pipeline.step import StepDef, transient


class ClientError(Exception):
    """botocore's ClientError as the classifier sees it: by class name and `response`."""

    def __init__(self, code: str):
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class HTTPError(OSError):
    """requests' HTTPError: an OSError whose response says whether waiting helps."""

    def __init__(self, status: int):
        super().__init__(f"{status}")
        self.response = type("R", (), {"status_code": status})()


def _wrapped(inner: BaseException) -> BaseException:
    """The runner's StepFailed, raised from the build's exception."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise RuntimeError("step[x] failed") from exc
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (OSError(errno.EIO, "Input/output error"), True),
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (FileNotFoundError(errno.ENOENT, "missing"), False),
        (PermissionError(errno.EACCES, "denied"), False),
        (ValueError("sources.math.domain: not one of web, code, math"), False),
        (KeyError("tokens"), False),
        (RuntimeError("something else"), False),
        # a build in a child process reaches the runner as "ClassName: message"
        (RuntimeError("OSError: [Errno 5] Input/output error: '/mnt/x'"), True),
        (RuntimeError("ConnectionError: HTTPSConnectionPool: Max retries exceeded"), True),
        (RuntimeError("OSError: [Errno 28] No space left on device"), False),
        (RuntimeError("ValueError: curation kept no documents"), False),
        (RuntimeError("child exited with code -9: ..."), False),
        # S3 after the storage layer's own backoff
        (_wrapped(StorageError("upload x failed after 5 attempts")), False),
        (ClientError("SlowDown"), True),
        (ClientError("AccessDenied"), False),
        (HTTPError(503), True),
        (HTTPError(404), False),
        # training jobs: killed or preempted resumes, a Python error or NaN does not
        (LaunchFailed("torchrun", facts=FailureFacts(rank=0, exitcode=-9, signal="SIGKILL")), True),
        (LaunchFailed("Slurm job 7", facts=FailureFacts(who="Slurm job 7", state="NODE_FAIL")), True),
        (LaunchFailed("torchrun", facts=FailureFacts(rank=0, exitcode=3)), False),
        (LaunchFailed("torchrun", facts=FailureFacts(rank=1, exitcode=1, error="ValueError: bad")), False),
        (LaunchFailed("sbatch: invalid partition"), False),
    ],
)
def test_transient(exc, expected):
    assert transient(exc) is expected
    assert transient(_wrapped(exc)) is expected  # as the runner raises it


def test_storage_error_after_retries_is_transient_when_its_cause_is():
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError as exc:
            raise StorageError("upload x failed after 5 attempts") from exc
    except StorageError as err:
        assert transient(err)


def test_retries_are_declared_where_they_help():
    """Data steps and exports retry transient IO; a training stage and each post-training
    trainer retry once (they resume from their checkpoint); evaluations do not."""
    from flows import ablation, anneal, cpt, smollm3

    steps = {v.name: v for m in (smollm3, anneal, cpt, ablation) for v in vars(m).values() if isinstance(v, StepDef)}
    for name in (
        "source",
        "curate",
        "tokenizer",
        "fertility",
        "tokenize",
        "eval_suite",
        "posttrain_data",
        "heldout_tokens",
        "export",
    ):
        assert steps[name].retries >= 1, name
    for name in ("pretrain", "sft", "preference", "grpo", "distill"):
        assert steps[name].retries == 1 and steps[name].resumable, name
    for name in ("evaluate", "merge", "mixture", "preflight", "compare"):
        assert steps[name].retries == 0, name
