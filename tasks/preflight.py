"""The preflight step: measure the machine, storage, data and recipe before training starts.

    g.add(preflight, PreflightSpec.for_recipe(cfg, run_id), label="preflight",
          tokenizer=chosen, mixtures=[...plans])

The build runs `infra.preflight.run_preflight`, writes `preflight.json` (every result, the config,
the facts, host and time) and `preflight.md` (the table) into the step folder
(infra/preflight/outcome.py), and raises `PreflightFailed` listing the blocking checks when
`should_stop` says so, so the flow stops before any training stage launches. The publish hook records one `preflight` lineage row per check and a
Prefect table artifact.

Caching: a preflight is a measurement of this host for this recipe. Its fingerprint holds the
host name (through `extra`), the checks' config and the facts of what the recipe trains (device,
batch, sequence lengths, vocabulary, model size, token budgets), so a rerun on the same host reuses
it and another host, model or data measures again; `--refresh preflight` measures again on demand.
Facts that come from operational settings (ranks per node, micro-batch, TP and CP degrees, each
stage's own layout, checkpoints kept, the workspace path) and the run id are operational (a
stage's own global batch rides with its layout: the recipe check refuses one its ranks cannot
split before any step runs, flows/fit.py): they are checked, but changing them alone does not
invalidate an earlier measurement.

Calibration: the report holds this host's measured matmul rates (`calibration`: the fp32
`cpu_matmul` at the preflight's threads, the bf16 `gpu_matmul` of the slowest GPU), measured
once, before training, under the `train` slot. The pretrain step reads the newest calibration of
its workspace for the host it runs on (`host_calibration`, model/calibration.py) into the trainer's operational
`peak_calibration`: the MFU peak where no datasheet value applies (model/flops.py). A host fact,
like the slot's thread count: it never enters a fingerprint.

Where it runs: with a local launch, here, in the step's process (every check). With a Slurm launch
(the 3B recipe's), the checks about a node run on every node of the first stage's allocation as a
Slurm job (infra/preflight/cluster.py) and only the recipe checks (config review, data) run here,
so a login node without GPUs preflights the GPU cluster instead of failing `gpu_count`. Each node's
rows come back as `check@node` rows of the report and lineage; a node whose checks would stop
training (or that wrote no report) is named, and recorded in `{workspace}/launch/excluded_nodes.json`
(infra/launchers/exclude.py), which every cluster stage adopts before it renders its job
(`--exclude`). The step then stops the flow as any failing preflight does; run it again (a
flow-run retry, `--refresh preflight`) to check a fresh allocation without that node.

Deliberate break of the "build functions stay free of DuckDB" rule: a failing preflight never
reaches `publish` (the step raises, no marker is written), yet failures are what lineage must
remember. The build therefore records the rows of a failing run itself, in the lineage database of
the workspace that holds its step folder (`{workspace}/preflight/{fp}/`), before raising.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from infra.launchers import LaunchConfig
from infra.preflight import CheckResult, PreflightConfig, PreflightFacts, run_preflight
from infra.preflight.core import PreflightFailed, lineage_rows
from infra.preflight.gpu import cuda_available
from infra.preflight.outcome import REPORT_JSON, step_summary, stop_error, write_report
from model.calibration import calibrations
from model.config import model_facts
from pipeline.artifact import Artifact, operational
from pipeline.step import step
from pipeline.workspace import Workspace, resolve_workspace

if TYPE_CHECKING:  # at run time only where used: duckdb is not needed to read a recipe
    pass


class PreflightSpec(BaseModel):
    """The preflight step's config (see the module docstring for what is identity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preflight: PreflightConfig
    facts: dict[str, Any] = {}  # PreflightFacts fields of what the recipe trains
    run_facts: dict[str, Any] = operational({})  # PreflightFacts fields of how it runs
    model: str | None = None  # ModelConfig preset, sized at the tokenizer input's vocabulary
    model_overrides: dict[str, Any] = {}  # its recipe overrides
    run_id: str | None = operational(None)  # the flow run, for the lineage rows
    # where the first stage trains (its nodes, GPUs, host resources): slurm runs the node checks
    # there as a job; local (and kubernetes, for now) runs every check in the step's process
    launch: LaunchConfig = operational(LaunchConfig())

    @classmethod
    def for_recipe(
        cls, recipe: Any, run_id: str | None = None, launch: LaunchConfig | None = None, needs: Any = None
    ) -> PreflightSpec:
        """The preflight step's config for a recipe: identity facts, operational facts, the model;
        `launch` is the first stage's (sized), `needs` the largest HostNeeds of its stages
        (model/host_memory.py), given for a cluster launch."""
        t = recipe.training
        device = t.device if t.device != "auto" else ("cuda" if cuda_available() else "cpu")
        stages = tuple(recipe.stages)
        facts = {
            "device": device,
            "global_batch": t.global_batch,
            "stage_tokens": {st.name: st.tokens for st in stages},
            "stage_seq_len": {st.name: st.seq_len for st in stages},
            "seq_len": max((st.seq_len for st in stages), default=0),
        }
        run_facts = {
            "nodes": recipe.launch.nodes,
            "nproc_per_node": t.nproc_per_node,
            "tp": t.tp,  # the batch check splits the global batch over DP = world / (tp x cp)
            "cp": t.cp,
            # each stage's own layout (the long-context stages: their nodes, TP x CP, micro-batch)
            "stage_layouts": {st.name: _stage_layout(st) for st in stages if _stage_layout(st)},
            "micro_batch": t.micro_batch,
            "checkpoint_keep": t.keep_last + len(stages),
            "workspace": str(resolve_workspace(recipe.workspace)),  # never the current directory
            # the repeats a stage's recipe accepts, where it says (data_epochs holds it to them;
            # operational like the stage's own max_epochs, which only warns in its mixture)
            "stage_max_epochs": {st.name: st.max_epochs for st in stages if "max_epochs" in st.model_fields_set},
        }
        if needs is not None:  # what a node must give training (the host checks' thresholds)
            run_facts |= {"open_files": needs.open_files, "host_memory_gb": needs.mem_gb}
        return cls(
            preflight=recipe.preflight,
            facts=facts,
            run_facts=run_facts,
            model=t.model,
            model_overrides=dict(t.model_overrides),
            run_id=run_id,
            **({"launch": launch} if launch is not None else {}),
        )


def _stage_layout(stage: Any) -> dict[str, int]:
    """The layout keys a recipe stage sets apart from the training section (the batch check's)."""
    keys = ("nodes", "tp", "cp", "micro_batch", "global_batch")
    return {k: v for k in keys if (v := getattr(stage, k, None)) is not None}


def preflight_extra(config: PreflightSpec) -> str:
    """Facts outside the config that change the output: the host that is measured."""
    return socket.gethostname()


def _read_report(artifact: Artifact) -> dict[str, Any]:
    return json.loads((artifact.path / REPORT_JSON).read_text(encoding="utf-8"))


def publish_preflight(artifact: Artifact, ws: Workspace, label: str) -> None:
    """Lineage rows (one per check) and a Prefect table artifact of a finished preflight."""
    from prefect.artifacts import create_table_artifact

    report = _read_report(artifact)
    results = [CheckResult(**r) for r in report["results"]]
    ws.lineage().record_rows("preflight", lineage_rows(report["run_id"], results))
    key = re.sub(r"[^a-z0-9-]+", "-", f"preflight-{label}".lower()).strip("-")
    counts = ", ".join(f"{n} {s}" for s, n in report["summary"].items())
    create_table_artifact(
        table=[
            {"check": r.name, "status": r.status, "value": r.value, "threshold": r.threshold, "advice": r.advice}
            for r in results
        ],
        key=key,
        description=f"Preflight on {report['host']}: {counts}",
    )


@step(
    "preflight",
    version=3,
    kind="preflight",
    extra=preflight_extra,
    publish=publish_preflight,
    resource="train",
    isolate=True,
)
def preflight(
    config: PreflightSpec,
    tokenizer: Artifact | None = None,
    mixtures: tuple[Artifact, ...] = (),
    *,
    out: Path,
    log=print,
) -> dict[str, Any]:
    """Preflight for the recipe's facts, with the vocabulary of the chosen `tokenizer` (the
    fertility decision or the tokenizer) and the stages' mixture plans (`mixtures`)."""
    from curation.bpe import selected_tokenizer

    facts = {**config.facts, **config.run_facts}
    if tokenizer is not None and config.model:
        vocab = int(selected_tokenizer(tokenizer)["vocab_size"])
        facts.update(model_facts(config.model, config.model_overrides, vocab))
    facts["mixture_plans"] = tuple(str(a.path / "plan.json") for a in mixtures)
    if config.launch.kind == "slurm":
        return _measure_on_slurm(config, PreflightFacts.from_dict(facts), out, log=log)
    return _measure(config.preflight, PreflightFacts.from_dict(facts), out, log=log, run_id=config.run_id)


def _measure_on_slurm(spec: PreflightSpec, facts: PreflightFacts, out: Path, *, log) -> dict[str, Any]:
    """The recipe checks here, the node checks as a Slurm job on every node of the stage's
    allocation; bad nodes are excluded from the workspace's training jobs, then the stop rule."""
    from infra.launchers.base import FailureFacts
    from infra.launchers.exclude import exclude_node, excluded_nodes
    from infra.preflight.cluster import run_preflight_job, split_config

    config, launch = spec.preflight, spec.launch
    run_id = spec.run_id or f"preflight-{out.name}"
    workspace = out.parent.parent
    on_nodes, here = split_config(config)
    results = run_preflight(here, facts, log=log)
    job = run_preflight_job(launch, on_nodes, facts, out, excluded=excluded_nodes(workspace), log=log)
    results += job.rows(config)
    bad = job.bad_nodes()
    for node, why in bad.items():
        log(f"[preflight] node {node} must not train: {why}")
        exclude_node(
            workspace,
            FailureFacts(who=f"preflight job {job.job}", node=node),
            launch.max_excluded_nodes,
            log,
            cause=f"preflight job {job.job} ({run_id}): {why}",
        )
    extra = {
        "job": job.job,
        "job_state": job.state,
        "nodes": job.nodes,
        "bad_nodes": bad,
        "excluded_nodes": excluded_nodes(workspace),
    }
    report = write_report(out, run_id, config, facts, results, log=log, extra=extra)
    if report["stop"]:
        Workspace.at(workspace).lineage().record_rows("preflight", lineage_rows(run_id, results))
        err = stop_error(results, config, out)
        if bad:
            note = (
                f"\nbad node(s) {', '.join(bad)}: excluded from this workspace's training jobs "
                f"({workspace / 'launch' / 'excluded_nodes.json'}); run preflight again (a flow-run retry, "
                "--refresh preflight) to check an allocation without them"
            )
            raise PreflightFailed(str(err) + note, results)
        raise err
    meta = step_summary(report, results)
    slowest = {k: job.slowest(c) for k, c in _NODE_METRICS.items()}
    return meta | slowest | {"nodes": job.nodes, "job": job.job, "excluded_nodes": extra["excluded_nodes"]}


# the step's headline figures on a cluster: the slowest node's (it paces every synchronous step)
_NODE_METRICS = {
    "gpu_tflops": "gpu_matmul",
    "nccl_busbw_gbps": "nccl_allreduce",
    "cpu_gflops": "cpu_matmul",
    "gloo_busbw_gbps": "gloo_allreduce",
}


def _measure(
    config: PreflightConfig, facts: PreflightFacts, out: Path, *, log, run_id: str | None, **doubles: Any
) -> dict[str, Any]:
    """Run the checks, write the report (with this host's calibration) into `out`; a failing run
    records its rows in the lineage of the workspace holding `out`, then raises PreflightFailed.
    `doubles`: `gpu` / `commands` backends for tests (infra.preflight.run_preflight)."""
    run_id = run_id or f"preflight-{out.name}"
    results = run_preflight(config, facts, log=log, **doubles)
    calibration = [c.model_dump(mode="json") for c in calibrations(results, config, socket.gethostname(), out.name)]
    report = write_report(out, run_id, config, facts, results, calibration=calibration, log=log)
    if report["stop"]:
        Workspace.at(out.parent.parent).lineage().record_rows("preflight", lineage_rows(run_id, results))
        raise stop_error(results, config, out)
    return step_summary(report, results)
