"""Every flow's graph by name: what `smollm3 plan` shows and the flows run (`--flow smollm3|anneal|cpt`).

The graphs come from the flow modules themselves (each module's `graph()`), built tolerant of
inputs missing on this machine, and the dry run is the engine's (pipeline/dryrun.py).
"""

from __future__ import annotations

from pipeline.dryrun import PlanRow, plan_graph
from pipeline.graph import Graph
from pipeline.workspace import Workspace

FLOWS = ("smollm3", "anneal", "cpt")


def flow_graph(flow: str, recipe, base: str = "") -> Graph:
    """The graph flow `flow` would run for `recipe` (tolerant of inputs missing on this machine)."""
    if flow == "smollm3":
        from flows.smollm3 import graph

        return graph(recipe, tolerant=True)
    if flow == "anneal":
        from flows.anneal import graph, resolve

        return graph(recipe, resolve(recipe, base), tolerant=True)
    if flow == "cpt":
        from flows.cpt import graph, resolve

        return graph(recipe, resolve(recipe, base), tolerant=True)
    raise ValueError(f"unknown flow {flow!r}; flows: {', '.join(FLOWS)}")


def plan(recipe, refresh: frozenset[str] = frozenset(), flow: str = "smollm3", base: str = "") -> list[PlanRow]:
    """The plan of `flow` on `recipe` in the recipe's workspace."""
    return plan_graph(flow_graph(flow, recipe, base), Workspace.at(recipe.workspace), frozenset(refresh))
