"""A pipeline step as data: name, version, what it produces, its typed config and how it builds.

    @step("curate", version=7, kind="corpus", resource="data", isolate=True)
    def curate(config: CurationConfig, corpus: Artifact,
               *, out: Path, log=print) -> dict: ...

makes `curate` a `StepDef` (Marin's "a step is data"). The function is the step: its signature is

    (config, <inputs...>, *, out, log=print[, progress=None])

- `config`: the step's typed config (its annotation is `StepDef.config_type`);
- the named inputs, one parameter each, annotated with what the graph may give it:
  `Artifact` (one artifact, required), `Artifact | None = None` (one, optional) or
  `tuple[Artifact, ...]` (a list; optional with the default `()`). A step whose input names are
  only known per config (`compare`: `{run}.lm`, `{run}.heldout`) takes `**inputs` instead;
- keyword-only: `out`, the step folder to write into; `log`, a line callback; `progress(percent)`
  when the step reports progress.

It returns the Artifact's meta. `StepDef.inputs` lists the input parameters, `Graph.add` checks a
node's inputs against them, `StepDef.run` passes a node's resolved inputs as those parameters (a
single artifact given for a list parameter arrives as a 1-tuple), and calling the StepDef calls
the function itself: `curate(cfg, corpus=art, out=folder)`. Nothing here imports Prefect:
pipeline/graph.py wires StepDefs into a graph, pipeline/runner.py runs it as Prefect tasks and
pipeline/dryrun.py predicts it.

Where a build runs:
- `isolate=True`: in a child process (pipeline/child.py), so Python-heavy work runs
  in parallel despite the GIL, libraries that patch globals (TRL, datatrove's loggers) stay out of
  the flow process, thread counts are the slot's own, and a cancelled or crashed run takes the
  child down with it (infra/proc.py). The child prints its log lines; `progress` reaches the parent
  as marked lines on the same stream.
- otherwise in the flow process (light steps, and steps whose work is already a subprocess, such
  as training stages launched through torchrun).
`resource` names the slot (recipe `resources`) the build holds while it runs: train, eval or
data; reusing a finished folder needs no slot.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

# which failures a retry can fix: infra/transient.py (infra uses it too), re-exported here
from infra.transient import TRANSIENT_ERRORS, transient  # noqa: F401
from pipeline.artifact import Artifact, ArtifactKind, Inputs, fingerprint

Resource = Literal["train", "eval", "data"]

# Keyword-only parameters of every build function; `out` is required, the others have defaults.
_KEYWORDS = ("out", "log", "progress")


@dataclass(frozen=True)
class InputParam:
    """One named input of a step, read from its function's signature."""

    name: str
    many: bool  # a list of artifacts (`tuple[Artifact, ...]`), else one artifact
    required: bool  # no default: the graph must give it

    def __str__(self) -> str:
        if self.many:
            return f"{self.name}: tuple[Artifact, ...]" + ("" if self.required else " = ()")
        return f"{self.name}: Artifact" + ("" if self.required else " | None = None")


# How an input parameter's annotation reads when it cannot be evaluated (a string annotation
# naming something the module does not define at decoration time), spaces removed.
_ANNOTATIONS = {
    "Artifact": "one",
    "Artifact|None": "optional",
    "None|Artifact": "optional",
    "Optional[Artifact]": "optional",
    "tuple[Artifact,...]": "many",
}


def _input_kind(annotation: Any, namespace: Mapping[str, Any]) -> str | None:
    """ "one", "optional" or "many" for an input parameter's annotation, None for anything else."""
    if isinstance(annotation, str):  # `from __future__ import annotations`
        try:
            annotation = eval(annotation, dict(namespace))  # noqa: S307
        except Exception:  # noqa: BLE001 (fall back to reading the string)
            return _ANNOTATIONS.get(annotation.replace(" ", ""))
    if annotation is Artifact:
        return "one"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and set(args) == {Artifact, type(None)}:
        return "optional"
    if origin is tuple and args == (Artifact, Ellipsis):
        return "many"
    return None


def read_signature(build: Callable[..., Any]) -> tuple[tuple[InputParam, ...], bool]:
    """The input parameters of a build function, and whether it takes `**inputs` (any names).

    Raises TypeError for a signature that is not `(config, <inputs...>, *, out, log=print
    [, progress=None])` (see the module docstring)."""
    where = f"step function {build.__module__}.{build.__qualname__}"
    namespace = vars(sys.modules[build.__module__]) if build.__module__ in sys.modules else {}
    params = list(inspect.signature(build).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].name != "config" or params[0].kind not in positional:
        raise TypeError(f"{where}: its first parameter must be `config`")
    inputs: list[InputParam] = []
    open_inputs = False
    keywords: set[str] = set()
    for p in params[1:]:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            open_inputs = True
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(f"{where}: *{p.name} is not a step parameter; name each input")
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            if p.name not in _KEYWORDS:
                raise TypeError(
                    f"{where}: keyword-only parameter {p.name!r} is none of {', '.join(_KEYWORDS)}; "
                    "inputs come before the `*`"
                )
            keywords.add(p.name)
        elif p.name in _KEYWORDS:
            raise TypeError(f"{where}: {p.name!r} must be keyword-only (after `*`)")
        else:
            kind = _input_kind(p.annotation, namespace)
            if kind is None:
                raise TypeError(
                    f"{where}: input {p.name!r} must be annotated `Artifact`, `Artifact | None` or "
                    f"`tuple[Artifact, ...]`, not {p.annotation!r}"
                )
            empty = p.default is inspect.Parameter.empty
            if kind == "one" and not empty:
                raise TypeError(
                    f"{where}: input {p.name!r} has a default; an optional input is `Artifact | None = None`"
                )
            if kind == "optional" and p.default is not None:
                raise TypeError(f"{where}: optional input {p.name!r} must default to None")
            if kind == "many" and not empty and p.default != ():
                raise TypeError(f"{where}: list input {p.name!r} must default to () or have no default")
            inputs.append(InputParam(p.name, many=kind == "many", required=empty and kind != "optional"))
    if "out" not in keywords:
        raise TypeError(f"{where}: it must take the step folder as a keyword-only `out`")
    return tuple(inputs), open_inputs


@dataclass(frozen=True, eq=False)
class StepDef:
    """A step as data: what it is called, its version, what it produces and how it builds."""

    name: str
    version: int
    kind: ArtifactKind
    build: Callable[..., dict[str, Any]]
    extra: Callable[[Any], str] | None = None  # facts outside the config that change the output
    resumable: bool = False  # keep an interrupted attempt's files (training resumes from them)
    # Called after a build (not on reuse) to publish Prefect artifacts and lineage fact rows:
    # publish(artifact, ws, label). Build functions stay free of Prefect and DuckDB.
    publish: Callable[..., None] | None = None
    resource: Resource | None = None  # slot held while building (recipe `resources`)
    isolate: bool = False  # build in a child process (see the module docstring)
    # Attempts after a failure whose cause is transient (see `transient`), `retry_delay` seconds
    # apart: a deterministic failure (bad config or data) fails at once.
    retries: int = 0
    retry_delay: float = 10.0

    @cached_property
    def config_type(self) -> type:
        """The class of the build's `config` argument (the step's typed config)."""
        annotation = self.build.__annotations__["config"]
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = eval(annotation, vars(sys.modules[self.build.__module__]))  # noqa: S307
        return annotation

    @cached_property
    def _signature(self) -> tuple[tuple[InputParam, ...], bool]:
        return read_signature(self.build)

    @property
    def inputs(self) -> tuple[InputParam, ...]:
        """The step's named inputs, in signature order (its function's parameters after `config`)."""
        return self._signature[0]

    @property
    def open_inputs(self) -> bool:
        """Whether the step takes inputs of any name (`**inputs`) besides its named ones."""
        return self._signature[1]

    def describe_inputs(self) -> str:
        """The step's inputs as its signature names them, e.g. `curate(corpus: Artifact, ...)`."""
        names = [str(p) for p in self.inputs] + (["**inputs"] if self.open_inputs else [])
        return f"{self.name}({', '.join(names)})"

    def check_inputs(self, given: Mapping[str, bool], where: str = "") -> None:
        """Refuse inputs the step's function would not take: a name that is none of its
        parameters, a required input left out, a list for a single-artifact parameter.
        `given`: input name -> whether it is a list; `where` names the node in the error."""
        where = where or f"step {self.name}"
        params = {p.name: p for p in self.inputs}
        for name, is_list in given.items():
            p = params.get(name)
            if p is None and not self.open_inputs:
                raise TypeError(f"{where}: unknown input {name!r}; the step takes {self.describe_inputs()}")
            if p is not None and is_list and not p.many:
                raise TypeError(
                    f"{where}: input {name!r} is one artifact, not a list; the step takes {self.describe_inputs()}"
                )
        missing = [p.name for p in self.inputs if p.required and p.name not in given]
        if missing:
            raise TypeError(
                f"{where}: missing input {', '.join(map(repr, missing))}; the step takes {self.describe_inputs()}"
            )

    @cached_property
    def code_version(self) -> str:
        """Hash of the step module's source: a changed module misses Prefect's cache (the marker
        of an unchanged fingerprint is still reused: outputs change only with `version`)."""
        module = sys.modules[self.build.__module__]
        return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:12]

    @cached_property
    def wants_progress(self) -> bool:
        return "progress" in inspect.signature(self.build).parameters

    def facts(self, config: Any) -> str:
        """`extra` of this config: facts outside it that change the output ("" when none)."""
        return self.extra(config) if self.extra else ""

    def fingerprint(self, config: Any, inputs: Inputs, extra: str) -> str:
        return fingerprint(self.name, self.version, config, inputs, extra)

    def run(
        self,
        config: Any,
        inputs: Inputs,
        out: Path,
        log: Callable[[str], None] = print,
        progress: Callable[[float], None] | None = None,
    ) -> dict[str, Any]:
        """Call the build function in this process with `inputs` (a node's resolved inputs, by
        name) as its parameters: a single artifact given for a list parameter arrives as a
        1-tuple, an optional input left out gets its default."""
        self.check_inputs({name: not isinstance(v, Artifact) for name, v in inputs.items()})
        params = {p.name: p for p in self.inputs}
        kwargs: dict[str, Any] = {}
        for name, value in inputs.items():
            p = params.get(name)
            if p is not None and p.many:
                value = (value,) if isinstance(value, Artifact) else tuple(value)
            elif p is None and not isinstance(value, Artifact):
                value = tuple(value)
            kwargs[name] = value
        kwargs.update(out=out, log=log)
        if self.wants_progress:
            kwargs["progress"] = progress or (lambda _: None)
        return self.build(config, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call the step's function itself: `curate(cfg, corpus=art, out=folder, log=print)`."""
        return self.build(*args, **kwargs)

    def __repr__(self) -> str:
        return f"StepDef({self.name!r}, version={self.version})"


def step(
    name: str,
    *,
    version: int,
    kind: ArtifactKind,
    extra: Callable[[Any], str] | None = None,
    resumable: bool = False,
    publish: Callable[..., None] | None = None,
    resource: Resource | None = None,
    isolate: bool = False,
    retries: int = 0,
    retry_delay: float = 10.0,
) -> Callable[[Callable[..., dict[str, Any]]], StepDef]:
    """Declare a pipeline step; see the module docstring."""

    def wrap(build: Callable[..., dict[str, Any]]) -> StepDef:
        read_signature(build)  # a signature that is not a step's fails at import
        return StepDef(name, version, kind, build, extra, resumable, publish, resource, isolate, retries, retry_delay)

    return wrap
