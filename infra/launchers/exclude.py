"""Nodes a training stage's next attempts keep away from, after failures that named them.

When a cluster launch fails and its failure names a node (`FailureFacts.node`: the host of the
rank whose heartbeat stopped, of the rank that hung, or of the peer a survivor lost; with
`FailureFacts.more_nodes`, every node the scheduler says the job lost: Slurm's down nodes of a
NODE_FAIL, the nodes Kubernetes lost pods with), each is added to
`{stage folder}/launch/excluded_nodes.json` (written atomically), with the failure's cause and
time. Every later render of the stage reads it: Slurm puts `#SBATCH --exclude=a,b` in the
script, Kubernetes a required node anti-affinity (`kubernetes.io/hostname NotIn [a, b]`) in every
pod of the PyTorchJob. The list grows over the stage's attempts (a Prefect retry, a flow-run
retry, a rerun: the folder is the stage's), up to `launch.max_excluded_nodes`: past it, a further
node is not excluded and the log says so, since excluding too many nodes can leave the job
unschedulable. Delete the file to let the stage use every node again.

A preflight job that finds a bad node (infra/preflight/cluster.py) records it the same way, in the
workspace's own `{workspace}/launch/excluded_nodes.json` (`exclude_node` with the preflight's
cause); each cluster stage adopts that list into its own before it renders (`adopt_excluded`), so
the training jobs of the run, and of later runs in the workspace, keep away from it. Delete the
workspace's file (and a stage's) to let the node back in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from infra.files import read_json, write_json_atomic
from infra.launchers.base import FailureFacts

EXCLUDED_FILE = Path("launch") / "excluded_nodes.json"


def excluded_nodes(workdir: Path) -> list[str]:
    """The nodes the stage in `workdir` excludes, in the order they were added ([] when none)."""
    record = read_json(Path(workdir) / EXCLUDED_FILE)
    nodes = record.get("nodes") if isinstance(record, dict) else None
    return [n for n in nodes if isinstance(n, str) and n] if isinstance(nodes, list) else []


def exclude_node(
    workdir: Path, facts: FailureFacts, limit: int, log: Callable[[str], None] = print, cause: str | None = None
) -> FailureFacts:
    """Add the nodes `facts` blames (`FailureFacts.nodes`) to the stage's excluded nodes (each
    unless already there, or the stage already excludes `limit` nodes: then the log says it is
    not); `facts` with `excluded` set to every node the next attempt excludes, so that its cause
    (and the lineage row) says so. `cause` replaces `facts.cause()` in the record (a preflight's
    finding is no launch failure)."""
    nodes = excluded_nodes(workdir)
    for node in facts.nodes:
        if node in nodes:
            continue
        if len(nodes) >= limit:
            log(
                f"[launch] WARNING: not excluding node {node} from the next attempt: the stage already "
                f"excludes {len(nodes)} node(s) ({', '.join(nodes) or 'none'}), launch.max_excluded_nodes is "
                f"{limit}; excluding more could leave the job unschedulable. Check the nodes, then delete "
                f"{Path(workdir) / EXCLUDED_FILE} or raise the limit"
            )
            continue
        path = Path(workdir) / EXCLUDED_FILE
        record = read_json(path)
        causes = record.get("causes") if isinstance(record, dict) else None
        causes = [
            *(causes if isinstance(causes, list) else []),
            {"node": node, "cause": cause or facts.cause(), "time": time.time()},
        ]
        nodes.append(node)
        write_json_atomic(path, {"nodes": nodes, "causes": causes})
        log(f"[launch] node {node} is excluded from the stage's next attempts (all excluded: {', '.join(nodes)})")
    return replace(facts, excluded=tuple(nodes)) if nodes else facts


def adopt_excluded(workdir: Path, source: Path, limit: int, log: Callable[[str], None] = print) -> list[str]:
    """Add the nodes `source` (a folder with its own `launch/excluded_nodes.json`: the workspace,
    where preflight records bad nodes) excludes to the stage in `workdir`, each with its recorded
    cause, within `limit`; every node the stage now excludes."""
    record = read_json(Path(source) / EXCLUDED_FILE)
    causes = record.get("causes") if isinstance(record, dict) else None
    why = {c.get("node"): c.get("cause") for c in causes or () if isinstance(c, dict)}
    for node in excluded_nodes(source):
        if node not in excluded_nodes(workdir):
            cause = str(why.get(node) or f"excluded by {Path(source) / EXCLUDED_FILE}")
            exclude_node(workdir, FailureFacts(who="preflight", node=node), limit, log, cause=cause)
    return excluded_nodes(workdir)
