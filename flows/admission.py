"""Refuse a run before anything starts: the same checks for `smollm3 run` and for served runs.

A run's parameters (recipe, overrides, refresh, variants) can be wrong in ways only the project
knows: a misspelt recipe, an override of a field that does not exist, a glob that matches no
data. The flows check them first thing, but "first thing" came late: `smollm3 run` started (or
looked for) a Prefect server first, and a deployment run waited for its concurrency slot first
(28 minutes in `AwaitingConcurrencySlot` behind a running run) before failing with a message it
could have given at once. So:

- `check_run(flow, parameters)` is what a run of `flow` refuses, by the functions the flow and
  `smollm3 plan` use (flows/recipe.py `load_recipe` and `check_data`, the flow's graph,
  flows/params.py `check_refresh`), importing no Prefect. `smollm3 run` calls it before it
  touches Prefect.
- `refuse_invalid_runs(client, deployments)` looks at the scheduled runs of the served
  deployments (Scheduled, Late, AwaitingConcurrencySlot, AwaitingRetry) and sets each run whose
  parameters `check_run` refuses to Failed with that message, so it never waits for a slot;
  the serve process runs it every two seconds beside `serve()` (`watch_scheduled_runs`).

What a run can only know when it starts (the base checkpoint an anneal resolves from the newest
run, which may still be training) is checked by the run itself, as before.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

# The failures that are the parameters' fault (what the CLI answers with exit 2), not a bug.
REFUSALS = (ValueError, LookupError, FileNotFoundError)


def check_smollm3(recipe: str = "tiny", overrides: Iterable[str] | None = None, refresh=None, **_: Any) -> Any:
    """What `smollm3/full` and `smollm3 run` refuse before any step: the recipe and overrides,
    the data sources as configured, the graph (inputs that cannot be read), the refresh names."""
    from flows.params import check_refresh
    from flows.recipe import check_data, load_recipe
    from flows.smollm3 import graph

    check_refresh("smollm3", refresh or [])
    cfg = load_recipe(recipe, list(overrides or []))
    check_data(cfg)
    graph(cfg)
    return cfg


def _check_continuation(flow: str) -> Callable[..., Any]:
    def check(recipe: str = "tiny", overrides: Iterable[str] | None = None, refresh=None, **_: Any) -> Any:
        """The recipe, overrides and refresh names of an anneal or continued pretraining (its base
        is resolved when it starts: the run it continues may still be training)."""
        from flows.params import check_refresh
        from flows.recipe import load_recipe

        check_refresh(flow, refresh or [])
        return load_recipe(recipe, list(overrides or []))

    return check


def check_ablation(
    recipe: str = "tiny",
    variants: Iterable[str] | None = None,
    seeds: int = 2,
    overrides: Iterable[str] | None = None,
    eval_every: int | None = None,
    heldout_tokens: int = 8192,
    lm_eval: str = "stages",
    confidence: float = 0.95,
    name: str = "",
    **_: Any,
) -> Any:
    """The ablation's variants and every arm's recipe and data, as the flow checks them."""
    from flows.ablation import ablation_spec, arm_recipes
    from flows.recipe import check_data

    spec = ablation_spec(list(variants or []), seeds, eval_every, heldout_tokens, lm_eval, confidence, name)
    arms = arm_recipes(recipe, list(overrides or []), spec.variants)
    checked: list[Any] = []
    for cfg in arms.values():
        if cfg.sources not in checked:
            check_data(cfg)
            checked.append(cfg.sources)
    return arms


CHECKS: dict[str, Callable[..., Any]] = {
    "smollm3": check_smollm3,
    "anneal": _check_continuation("anneal"),
    "cpt": _check_continuation("cpt"),
    "ablation": check_ablation,
}


def check_run(flow: str, parameters: Mapping[str, Any]) -> Any:
    """Raise what a run of `flow` with `parameters` would fail with before its first step."""
    if flow not in CHECKS:
        raise ValueError(f"unknown flow {flow!r}; flows: {', '.join(CHECKS)}")
    return CHECKS[flow](**dict(parameters))


def refusal(exc: BaseException) -> str:
    """The state message of a refused run: the error the run itself would have failed with."""
    return f"Refused before it started (its parameters): {type(exc).__name__}: {exc}"


# --- served runs -----------------------------------------------------------------------------


class ScheduledRunCheck:
    """Served deployments' scheduled runs, each checked once per set of parameters."""

    def __init__(self, deployments: Iterable[tuple[str, str]]):
        self.deployments = list(deployments)  # (flow name, deployment name)
        self.ids: dict[Any, str] = {}  # deployment id -> flow name, once registered
        self.seen: set[tuple[str, str]] = set()  # (run id, parameters) already checked

    def _resolve_ids(self, client) -> None:
        from prefect.exceptions import ObjectNotFound

        for flow, name in self.deployments:
            if flow in self.ids.values():
                continue
            try:
                self.ids[client.read_deployment_by_name(f"{flow}/{name}").id] = flow
            except ObjectNotFound:  # serve has not registered it yet
                continue

    def refuse_invalid_runs(self, client) -> list[tuple[str, str]]:
        """One look: each scheduled run whose parameters `check_run` refuses is set Failed, with
        the refusal as its message. Returns (run id, message) of the refused runs."""
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.states import Failed

        self._resolve_ids(client)
        if not self.ids:
            return []
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
            ),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=list(self.ids))),
            limit=200,
        )
        refused = []
        for run in runs:
            key = (str(run.id), json.dumps(run.parameters, sort_keys=True, default=str))
            if key in self.seen:
                continue
            self.seen.add(key)
            try:
                check_run(self.ids[run.deployment_id], run.parameters)
            except REFUSALS as exc:
                message = refusal(exc)
                client.set_flow_run_state(run.id, Failed(message=message), force=True)
                log.warning("flow run %s (%s): %s", run.name, run.id, message)
                refused.append((str(run.id), message))
            except Exception as exc:  # noqa: BLE001 - not the parameters' fault: the run will say
                log.warning("could not check flow run %s before it starts (%s: %s)", run.id, type(exc).__name__, exc)
        return refused


def watch_scheduled_runs(
    deployments: Iterable[tuple[str, str]], every_s: float = 2.0, stop: threading.Event | None = None
) -> threading.Thread:
    """A daemon thread of the serve process: `refuse_invalid_runs` every `every_s` seconds, until
    `stop` is set (never, in the serve process)."""
    from prefect.client.orchestration import get_client

    check = ScheduledRunCheck(deployments)
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                with get_client(sync_client=True) as client:
                    while not stop.is_set():
                        check.refuse_invalid_runs(client)
                        stop.wait(every_s)
            except Exception as exc:  # noqa: BLE001 - the server restarting; look again soon
                log.warning("checking scheduled runs failed (%s: %s); retrying", type(exc).__name__, exc)
                stop.wait(every_s * 5)

    thread = threading.Thread(target=loop, name="scheduled-run-check", daemon=True)
    thread.start()
    return thread
