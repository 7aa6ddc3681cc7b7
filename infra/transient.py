"""Which failures a retry can fix (`transient`): IO and network errors, S3 throttling, a training
launch that ended for a reason outside its code and data. Used by the step runner's retry
condition (pipeline/step.py re-exports it, pipeline/runner.py) and by infra itself (a checkpoint
pull that fails on the network is raised as it is, not taken for a damaged checkpoint:
infra/storage.py), so it lives below both.
"""

from __future__ import annotations

import errno

# Errors of the file system or the network that a second attempt can outlive (a flaky mount, a
# dropped connection, S3 throttling after its own backoff), by class name: a build in a child
# process reaches the runner as "ClassName: message" (pipeline.child), not as the exception.
TRANSIENT_ERRORS = frozenset(
    {
        "OSError",
        "IOError",
        "TimeoutError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "InterruptedError",
        "IncompleteRead",
        "RemoteDisconnected",
        "ProtocolError",
        "ChunkedEncodingError",
        "ReadTimeout",
        "ConnectTimeout",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ResponseStreamingError",
    }
)
# OSErrors that say something about the input or the machine that waiting does not change.
_LASTING_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOSPC,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.EDQUOT,
}
_S3_RETRYABLE = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}
# Scheduler end states of a training job that a resumed job outlives.
_JOB_STATES = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "TIMEOUT", "DEADLINE"}


def transient(exc: BaseException | None) -> bool:
    """Whether a failure (or any exception it was raised from) can go away by running again:
    IO and network errors, S3 throttling, a training job whose rank was killed by a signal (OOM
    killer, preemption), stopped on one after saving its step, lost a peer node, hung (ended by
    its watchdog), or whose node failed or time ran out (a retry resumes from the last
    checkpoint). Config, data and code errors (ValueError, a missing file, a non-finite loss, a
    Python error in a rank) are not: retrying them only repeats them."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        facts = getattr(exc, "facts", None)  # infra.launchers.LaunchFailed: how the job ended
        if facts is not None and hasattr(facts, "signal"):
            # a stop signal the trainer checkpointed on, a lost peer (`external`, FailureFacts), or a
            # hung launch ended by its watchdog: the retry resumes from the last checkpoint
            return (
                bool(facts.signal)
                or (facts.state or "").upper() in _JOB_STATES
                or bool(getattr(facts, "external", False))
                or bool(getattr(facts, "hung", None))
            )
        name = type(exc).__name__
        if name == "ClientError":  # botocore: only throttling and server-side errors
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in _S3_RETRYABLE:
                return True
        elif name.endswith("HTTPError"):  # requests/huggingface_hub: an OSError, but a 404 stays
            status = getattr(getattr(exc, "response", None), "status_code", None)
            return status in (408, 429, 500, 502, 503, 504)
        elif isinstance(exc, OSError) or name in TRANSIENT_ERRORS:
            return getattr(exc, "errno", None) not in _LASTING_ERRNOS and not isinstance(
                exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError | FileExistsError
            )
        elif type(exc) is RuntimeError:  # a child's failure: "ClassName: message"
            head, sep, rest = str(exc).partition(": ")
            if sep and head in TRANSIENT_ERRORS:
                return not any(f"[Errno {n}]" in rest for n in _LASTING_ERRNOS)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False
