"""A step is its function (inputs from its signature, called directly or by `run`), which step
failures a retry can fix (pipeline.step.transient), and the retry policy of the steps."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from infra.launchers.base import FailureFacts, LaunchFailed
from infra.storage import StorageError
from pipeline.artifact import Artifact
from pipeline.step import InputParam, StepDef, step, transient


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
        # ended by its hang watchdog (exit 5), or by the step when torchrun itself was frozen
        (LaunchFailed("torchrun", facts=FailureFacts(rank=0, exitcode=5, hung="rank 1 on n completed no step")), True),
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
        "heldout_index",
        "decontaminate",
        "tokenizer",
        "fertility",
        "tokenize",
        "eval_suite",
        "posttrain_data",
        "heldout_tokens",
        "export",
    ):
        assert steps[name].retries >= 1, name
    for name in ("pretrain", "sft", "preference", "grpo", "sao", "distill"):
        assert steps[name].retries == 1 and steps[name].resumable, name
    for name in ("evaluate", "merge", "mixture", "preflight", "compare"):
        assert steps[name].retries == 0, name


# --- the function is the step -----------------------------------------------------------------


class Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    value: int = 0


@step("joins", version=1, kind="report")
def joins(
    config: Cfg,
    corpus: Artifact,
    tokenizer: Artifact | None = None,
    others: tuple[Artifact, ...] = (),
    *,
    out: Path,
    log=print,
) -> dict:
    """Returns what it was given, by input."""
    return {
        "corpus": corpus.fingerprint,
        "tokenizer": None if tokenizer is None else tokenizer.fingerprint,
        "others": [a.fingerprint for a in others],
        "out": str(out),
    }


@step("named_by_config", version=1, kind="report")
def named_by_config(config: Cfg, *, out: Path, log=print, **inputs: Artifact | tuple[Artifact, ...]) -> dict:
    return {name: isinstance(v, Artifact) for name, v in inputs.items()}


def _art(c: str, kind: str = "corpus") -> Artifact:
    return Artifact(kind=kind, uri=f"/x/{c}", fingerprint=c * 64, meta={})


def test_a_steps_inputs_come_from_its_signature():
    assert joins.inputs == (
        InputParam("corpus", many=False, required=True),
        InputParam("tokenizer", many=False, required=False),
        InputParam("others", many=True, required=False),
    )
    assert not joins.open_inputs and joins.config_type is Cfg
    assert joins.describe_inputs() == (
        "joins(corpus: Artifact, tokenizer: Artifact | None = None, others: tuple[Artifact, ...] = ())"
    )
    assert named_by_config.inputs == () and named_by_config.open_inputs
    # the project's steps: named inputs, no `inputs` mapping
    from tasks.curate import curate
    from tasks.decontaminate import decontaminate
    from tasks.heldout_index import heldout_index
    from tasks.mixture import mixture
    from tasks.sources import source

    assert [(p.name, p.many, p.required) for p in curate.inputs] == [("corpus", False, True)]
    assert [(p.name, p.many, p.required) for p in heldout_index.inputs] == [("corpora", True, False)]
    assert [(p.name, p.many, p.required) for p in decontaminate.inputs] == [
        ("corpus", False, True),
        ("index", False, True),
    ]
    assert [(p.name, p.many, p.required) for p in mixture.inputs] == [("shards", True, True)]
    assert source.inputs == ()


def test_calling_the_step_calls_its_function(tmp_path):
    got = joins(Cfg(), corpus=_art("a"), others=[_art("b")], out=tmp_path, log=lambda _: None)
    assert got == {"corpus": "a" * 64, "tokenizer": None, "others": ["b" * 64], "out": str(tmp_path)}
    with pytest.raises(TypeError):
        joins(Cfg(), out=tmp_path)  # a plain call: Python's own error for a missing argument


def test_run_passes_each_input_as_its_parameter(tmp_path):
    a, b, t = _art("a"), _art("b"), _art("t", "tokenizer")
    # a single artifact given for a list parameter arrives as a 1-tuple; an absent optional input
    # gets its default
    got = joins.run(Cfg(), {"corpus": a, "others": b}, tmp_path, log=lambda _: None)
    assert got["others"] == ["b" * 64] and got["tokenizer"] is None
    got = joins.run(Cfg(), {"corpus": a, "tokenizer": t, "others": (b, a)}, tmp_path)
    assert got["others"] == ["b" * 64, "a" * 64] and got["tokenizer"] == "t" * 64
    with pytest.raises(TypeError, match=r"unknown input 'corpse'.*joins\(corpus: Artifact"):
        joins.run(Cfg(), {"corpse": a}, tmp_path)
    with pytest.raises(TypeError, match=r"missing input 'corpus'"):
        joins.run(Cfg(), {"others": (b,)}, tmp_path)
    with pytest.raises(TypeError, match=r"input 'corpus' is one artifact, not a list"):
        joins.run(Cfg(), {"corpus": (a, b)}, tmp_path)
    # a step with **inputs takes any names, as given
    assert named_by_config.run(Cfg(), {"x.lm": (a, b), "base": a}, tmp_path) == {"x.lm": False, "base": True}


def test_a_signature_that_is_not_a_steps_is_refused_when_declared():
    def no_out(config: Cfg, corpus: Artifact, *, log=print) -> dict:
        return {}

    def positional_out(config: Cfg, corpus: Artifact, out: Path, *, log=print) -> dict:
        return {}

    def untyped_input(config: Cfg, corpus, *, out: Path, log=print) -> dict:
        return {}

    def defaulted_single(config: Cfg, corpus: Artifact = None, *, out: Path, log=print) -> dict:  # type: ignore[assignment]
        return {}

    def other_keyword(config: Cfg, *, out: Path, log=print, seed: int = 0) -> dict:
        return {}

    for fn, message in (
        (no_out, "keyword-only `out`"),
        (positional_out, "'out' must be keyword-only"),
        (untyped_input, "input 'corpus' must be annotated"),
        (defaulted_single, "`Artifact | None = None`"),
        (other_keyword, "keyword-only parameter 'seed'"),
    ):
        with pytest.raises(TypeError, match=message):
            step("bad", version=1, kind="report")(fn)


def test_string_annotations_are_read_when_they_cannot_be_evaluated(monkeypatch):
    """`from __future__ import annotations` in a module that does not import Artifact at the
    point of declaration: the annotation is read as the string it is."""
    import sys
    import types

    module = types.ModuleType("fake_steps")
    monkeypatch.setitem(sys.modules, "fake_steps", module)
    source = (
        "from __future__ import annotations\n"
        "def build(config: dict, model: Artifact, init: Artifact | None = None,\n"
        "          data: tuple[Artifact, ...] = (), *, out, log=print):\n"
        "    return {}\n"
    )
    exec(compile(source, "fake_steps.py", "exec"), module.__dict__)
    d = step("fake", version=1, kind="report")(module.build)
    assert [(p.name, p.many, p.required) for p in d.inputs] == [
        ("model", False, True),
        ("init", False, False),
        ("data", True, False),
    ]
