"""The DAG as a value: steps with typed configs and named inputs, fingerprinted before anything runs.

A flow builds its graph first, then hands it to the runner:

    g = Graph("smollm3")
    raw = g.add(source, SourceSpec(source=s, seed=None), label="prose")
    clean = g.add(curate, cfg.curation.for_source(s), label="prose", corpus=raw)

Every node's fingerprint is known when it is added: it depends only on the step's version, the
identity fields of its config, the facts its `extra` reads (file digests) and its inputs'
fingerprints, never on what an input contains. So running (pipeline/runner.py), `smollm3 plan`
(pipeline/dryrun.py) and the Prefect UI all come from this one value: a node's inputs are exactly the
task inputs Prefect records for it and exactly the lineage edges its step writes.

Inputs are other nodes of the same graph, or `Given` artifacts that exist before the run (an
anneal's token shards, found through lineage): those are inputs but not steps of this run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from pipeline.artifact import Artifact
from pipeline.step import StepDef


@dataclass(frozen=True)
class Given:
    """An artifact that exists before the run: an input of a step, not a step of this run."""

    artifact: Artifact

    @property
    def fingerprint(self) -> str:
        return self.artifact.fingerprint


Ref = Union["Node", Given]


@dataclass(frozen=True, eq=False)
class Node:
    """One step of a graph: a StepDef, its label, typed config and named inputs."""

    step: StepDef
    label: str
    config: Any
    inputs: Mapping[str, Ref | tuple[Ref, ...]]
    extra: str  # the step's facts outside its config (file digests ...), read once
    fingerprint: str
    unresolved: str | None = None  # a fact that could not be read here (planning only)
    # Steps that must finish first without being inputs: a gate (preflight before the first
    # stage). They are dependencies in Prefect and lineage, never part of the fingerprint, so
    # measuring another host does not retrain anything.
    after: tuple[Node, ...] = ()
    # Attempts after a transient failure (pipeline.step.transient), None = the step's own
    # `retries`; never part of the fingerprint. A training stage takes the recipe's budget.
    retries: int | None = None
    # Seconds before the first retry (None = the step's `retry_delay`), doubled before each next
    # one up to `retry_delay_max`; never part of the fingerprint. A training stage takes the
    # recipe's `training.retry_backoff_s` and `training.retry_backoff_max_s`.
    retry_delay: float | None = None
    retry_delay_max: float = 900.0

    @property
    def attempts_after_failure(self) -> int:
        return self.step.retries if self.retries is None else self.retries

    def retry_delays(self) -> list[float]:
        """Seconds before each retry: the first delay, doubled each time, at most `retry_delay_max`."""
        first = self.step.retry_delay if self.retry_delay is None else self.retry_delay
        return [min(first * 2**k, self.retry_delay_max) for k in range(self.attempts_after_failure)]

    @property
    def key(self) -> str:
        """`step[label]`: the name of its Prefect task run and of its lineage rows."""
        return f"{self.step.name}[{self.label}]"

    @property
    def short(self) -> str:
        return self.fingerprint[:12]

    def refs(self) -> list[Ref]:
        """Every input, in input order."""
        out: list[Ref] = []
        for value in self.inputs.values():
            out += list(value) if isinstance(value, tuple) else [value]
        return out

    def parents(self) -> list[Node]:
        """The nodes of this graph this one depends on (inputs and gates, Given artifacts left
        out), each once."""
        seen: dict[int, Node] = {}
        for ref in [*self.refs(), *self.after]:
            if isinstance(ref, Node):
                seen.setdefault(id(ref), ref)
        return list(seen.values())

    def __repr__(self) -> str:
        return f"Node({self.key}, {self.short})"


@dataclass
class Graph:
    """A flow's DAG. Nodes are added in dependency order (an input must exist before its reader),
    so insertion order is a topological order."""

    name: str
    # plan only: a fact that cannot be read on this machine (a cluster path) marks the node
    # `unresolved` instead of failing, so the rest of the plan still resolves
    tolerant: bool = False
    nodes: list[Node] = field(default_factory=list)
    final: Node | None = None  # the node whose artifact the run reports as its result

    def add(
        self,
        step: StepDef,
        config: Any,
        *,
        label: str,
        after: Sequence[Node] = (),
        reuse: bool = False,
        retries: int | None = None,
        retry_delay: float | None = None,
        retry_delay_max: float = 900.0,
        **inputs: Ref | Sequence[Ref],
    ) -> Node:
        """Add one step; `inputs` name its inputs (a node, a Given artifact, or a list of them),
        as the parameters of the step's function name them: an unknown name, a required input
        left out or a list for a single-artifact parameter is refused here, before anything runs.
        A single node for a list parameter is kept as given (its fingerprint records it as one;
        the build receives a 1-tuple). `after` names gates (see Node.after).

        reuse: when this exact step (same step, same fingerprint) is already in the graph, return
        that node, whatever its label, instead of adding a second one. An experiment builds each
        variant's graph into one graph this way, so the steps variants share appear once (its
        gates and label are the first one's).

        retries: attempts after a transient failure, instead of the step's own (Node.retries);
        retry_delay, retry_delay_max: their backoff (Node.retry_delay)."""
        if retries is not None and retries < 0:
            raise ValueError(f"{step.name}[{label}]: retries must be >= 0, got {retries}")
        if (retry_delay is not None and retry_delay < 0) or retry_delay_max < 0:
            raise ValueError(
                f"{step.name}[{label}]: retry delays must be >= 0, got retry_delay={retry_delay}, "
                f"retry_delay_max={retry_delay_max}"
            )
        if not isinstance(config, step.config_type):
            raise TypeError(
                f"{step.name}[{label}]: config must be a {step.config_type.__name__}, got {type(config).__name__}"
            )
        key = f"{step.name}[{label}]"
        step.check_inputs({name: isinstance(value, list | tuple) for name, value in inputs.items()}, where=key)
        mine = {id(n) for n in self.nodes}
        named: dict[str, Ref | tuple[Ref, ...]] = {}
        for name, value in inputs.items():
            refs = tuple(value) if isinstance(value, list | tuple) else (value,)
            for ref in refs:
                if isinstance(ref, Node) and id(ref) not in mine:
                    raise ValueError(f"{key}: input {name!r} is {ref.key}, a node of another graph")
                if not isinstance(ref, Node | Given):
                    raise TypeError(f"{key}: input {name!r} must be a node or Given, got {type(ref).__name__}")
            named[name] = refs if isinstance(value, list | tuple) else value
        unresolved = None
        try:
            extra = step.facts(config)
        except (OSError, ValueError, KeyError, LookupError) as exc:
            if not self.tolerant:
                raise
            extra, unresolved = f"unresolved: {exc}", str(exc)
        for gate in after:
            if id(gate) not in mine:
                raise ValueError(f"{key}: gate {gate!r} is not a node of graph {self.name}")
        fp = step.fingerprint(config, named, extra)
        if reuse:
            same = next((n for n in self.nodes if n.step is step and n.fingerprint == fp), None)
            if same is not None:
                return same
        if any(n.key == key for n in self.nodes):
            raise ValueError(f"graph {self.name}: step {key} is added twice; give it another label")
        node = Node(
            step, label, config, named, extra, fp, unresolved, tuple(after), retries, retry_delay, retry_delay_max
        )
        self.nodes.append(node)
        self.final = node
        return node

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, key: str) -> Node:
        for n in self.nodes:
            if n.key == key:
                return n
        raise KeyError(f"graph {self.name} has no step {key}; steps: {', '.join(n.key for n in self.nodes)}")

    @property
    def steps(self) -> tuple[str, ...]:
        """Step names, each once, in graph order."""
        return tuple(dict.fromkeys(n.step.name for n in self.nodes))

    def edges(self) -> set[tuple[str, str]]:
        """(parent key, child key) for every input that is a step of this graph."""
        return {(p.key, n.key) for n in self.nodes for p in n.parents()}

    def descendants(self, keys: set[str]) -> set[str]:
        """Keys of the nodes downstream of `keys` (themselves included)."""
        out = set(keys)
        for n in self.nodes:
            if any(p.key in out for p in n.parents()):
                out.add(n.key)
        return out


def prefect_flow(name: str, fn: Callable[..., Any], module: str, max_workers: int = 256) -> Any:
    """The Prefect flow `name` around `fn` (a flow module's function, whose signature and `Args:`
    are the run form), on a task runner that names pending task runs `step[label]`. Called by
    flows/prefect_flows.py only, so that importing a flow module (its `graph()`: planning, the CLI)
    never imports Prefect. `module` is the module that holds the flow as its attribute `name`:
    a served deployment's entrypoint is that module's file and `name` (Prefect reads both from
    the function), which is where the flow-run process loads the flow from."""
    from prefect import flow

    from pipeline.named_runs import NamedTaskRunner  # pending task runs named step[label]

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    return flow(name=name, log_prints=True, task_runner=NamedTaskRunner(max_workers=max_workers))(fn)
