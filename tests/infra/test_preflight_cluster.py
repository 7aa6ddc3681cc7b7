"""The preflight job (infra/preflight/cluster.py): what it renders and how it judges nodes, and,
on the tests' real one-node Slurm cluster, the preflight step submitting it: the node's rows come
back into the step's report and lineage, a healthy node is not flagged, and a node made bad from
outside (an allocation whose memory, SLURM_MEM_PER_NODE from the job's --mem, is below what
training needs) is named and excluded from the next training job's `--exclude`."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

import tasks.preflight as tp
from infra.launchers import LaunchConfig, SlurmLaunchConfig, get_launcher
from infra.launchers.exclude import adopt_excluded, excluded_nodes
from infra.preflight import CheckResult, PreflightConfig, PreflightFacts
from infra.preflight.cluster import JobOutcome, render_slurm, split_config
from infra.preflight.core import PreflightFailed
from pipeline.artifact import run_step
from pipeline.workspace import Workspace

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# one recipe check (here) and the node checks a CPU node can run (there)
CHECKS = ("batch_layout", "gpu_count", "cpu_matmul", "open_files", "host_memory", "checkpoint_io")


def slurm_launch(setup: tuple[str, ...] = (), **kw) -> LaunchConfig:
    return LaunchConfig(
        kind="slurm",
        nodes=1,
        procs_per_node=2,
        torchrun=TORCHRUN,
        slurm=SlurmLaunchConfig(
            time="00:10:00", cpus_per_task=2, poll_seconds=0.5, job_name="smollm3-test", setup=setup, **kw
        ),
    )


def preflight_config(**kw) -> PreflightConfig:
    return PreflightConfig(
        **{"checks": CHECKS, "cpu_matmul_size": 64, "cpu_matmul_seconds": 0.05, "io_probe_mib": 4} | kw
    )


# --- what the job is, without a cluster ------------------------------------------------------------


def test_node_checks_run_on_the_nodes_and_recipe_checks_here():
    on_nodes, here = split_config(PreflightConfig(skip=("dcgm_diag",)))
    assert {"gpu_matmul", "dcgm_diag", "nccl_allreduce", "open_files", "host_memory", "checkpoint_io"} <= set(
        on_nodes.checks
    )
    assert {"batch_layout", "shards", "vocab", "eval_tasks"} <= set(here.checks)
    assert not set(on_nodes.checks) & set(here.checks)
    assert on_nodes.skip == ("dcgm_diag",)


def test_the_job_has_the_stages_shape_and_keeps_off_excluded_nodes(tmp_path):
    launch = LaunchConfig(
        kind="slurm",
        nodes=48,
        procs_per_node=8,
        gpus_per_node=8,
        torchrun="/opt/venv/bin/torchrun",
        slurm=SlurmLaunchConfig(partition="hopper-prod", mem="94G", cpus_per_task=89, setup=("module load cuda",)),
    )
    script = render_slurm(launch, PreflightConfig(), tmp_path / "out", excluded=["gpu-7", "gpu-9"])
    for line in (
        "#SBATCH --nodes=48",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --mem=94G",
        "#SBATCH --cpus-per-task=89",
        "#SBATCH --partition=hopper-prod",
        "#SBATCH --exclusive",
        "#SBATCH --exclude=gpu-7,gpu-9",
        "#SBATCH --no-requeue",
        "module load cuda",
    ):
        assert line in script.splitlines()
    assert "/opt/venv/bin/python -m infra.preflight" in script
    assert f'--node "$SLURMD_NODENAME" --json {tmp_path}/out/nodes/"$SLURMD_NODENAME".json' in script
    assert "--nproc-per-node=8" in script and "--backend nccl" in script  # across all nodes' GPUs
    assert "--exclude" not in render_slurm(launch, PreflightConfig(), tmp_path / "out")


def test_a_node_without_a_report_is_bad_and_a_passing_one_is_not(tmp_path):
    ok = [CheckResult("open_files", "pass", "soft 1024, hard 4096")]
    outcome = JobOutcome(
        job="7", state="COMPLETED", nodes=["a", "b", "c"], results={"a": ok, "b": None, "c": ok}, log=tmp_path / "l"
    )
    outcome.results["c"] = [CheckResult("open_files", "fail", "soft 512, hard 512")]
    outcome.nodes.append("d")  # a warning (here slow storage under load) stops a run but excludes no node
    outcome.results["d"] = [CheckResult("checkpoint_io", "warn", "read 44 MB/s")]
    bad = outcome.bad_nodes()
    assert set(bad) == {"b", "c"}
    assert "wrote no report" in bad["b"] and "open_files FAIL soft 512, hard 512" in bad["c"]
    names = [r.name for r in outcome.rows(PreflightConfig())]
    assert names == ["open_files@a", "report@b", "open_files@c", "checkpoint_io@d", "allreduce_nodes"]


# --- on the real one-node Slurm cluster --------------------------------------------------------------


def _run(ws: Workspace, launch: LaunchConfig, run_id: str, **config):
    facts = PreflightFacts(
        nproc_per_node=2, global_batch=8, micro_batch=2, workspace=str(ws.root), open_files=4096, host_memory_gb=0.5
    )
    spec = tp.PreflightSpec(preflight=preflight_config(**config), facts=facts.to_dict(), launch=launch, run_id=run_id)
    d = tp.preflight
    lines: list[str] = []
    outcome = run_step(
        root=ws.path,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config=spec,
        inputs={},
        build=lambda out: d.run(spec, {}, out, log=lines.append),
        extra=d.facts(spec),
    )
    return outcome, lines


def _node() -> str:
    return socket.gethostname().split(".")[0]  # the fixture's node name


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_preflight_runs_as_a_job_on_the_node_and_a_node_made_bad_is_excluded(local_slurm, tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    node = _node()

    # Healthy: the job runs the node checks on the node, its rows come back, nothing is flagged.
    # allow_warn: the timed storage probe may warn on this loaded machine (44 MB/s once, in a full
    # run); a warning excludes no node either way (`bad_nodes`), and stopping on one is the local rule
    outcome, lines = _run(ws, slurm_launch(), "run-good", allow_warn=True)
    meta = outcome.artifact.meta
    assert meta["nodes"] == [node] and meta["job"].isdigit() and meta["excluded_nodes"] == []
    report = json.loads((outcome.artifact.path / "preflight.json").read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert rows["batch_layout"]["status"] == "pass"  # the recipe check, in the step's process
    assert "gpu_count" not in rows  # not asked of a login node: it runs on the node ...
    assert rows[f"gpu_count@{node}"]["status"] == "skip"  # ... where a CPU recipe skips it
    for check in ("open_files", "host_memory", "cpu_matmul"):
        assert rows[f"{check}@{node}"]["status"] == "pass", rows[f"{check}@{node}"]
    assert rows[f"checkpoint_io@{node}"]["status"] in {"pass", "warn"}, rows[f"checkpoint_io@{node}"]  # timed
    assert rows["allreduce_nodes"]["status"] == "pass" and "2 ranks, gloo" in rows["allreduce_nodes"]["value"]
    assert report["bad_nodes"] == {} and excluded_nodes(ws.root) == []
    assert (outcome.artifact.path / "nodes" / f"{node}.json").exists()
    assert any(f"[preflight] job {meta['job']} on 1 node(s) {node}" in line for line in lines)  # the job's log

    # A job shell's `ulimit -n 512` is no fault: srun propagates soft limits only, and the job
    # raises its soft limit itself. (Another probe size each time: the same preflight config
    # would be the finished step above, reused; allow_warn as above: the full suite's load made
    # its 3 MiB storage probe warn once, 80 MB/s with fsync.)
    outcome, _ = _run(ws, slurm_launch(setup=("ulimit -n 512",)), "run-soft", io_probe_mib=3, allow_warn=True)
    report = json.loads((outcome.artifact.path / "preflight.json").read_text())
    assert report["bad_nodes"] == {} and excluded_nodes(ws.root) == []

    # Bad from outside: the allocation gives the node less host memory than training needs (the
    # job's --mem, which Slurm hands the node's tasks as SLURM_MEM_PER_NODE).
    with pytest.raises(PreflightFailed) as err:
        _run(ws, slurm_launch(mem="256M"), "run-bad", io_probe_mib=2)
    message = str(err.value)
    assert f"host_memory@{node}: FAIL 0.3 GB (Slurm --mem;" in message
    assert f"bad node(s) {node}: excluded" in message
    assert excluded_nodes(ws.root) == [node]
    record = json.loads((ws.path / "launch" / "excluded_nodes.json").read_text())
    assert "run-bad" in record["causes"][0]["cause"] and "host_memory FAIL" in record["causes"][0]["cause"]
    with ws.lineage().snapshot() as con:
        found = con.sql(
            "SELECT check_name, status FROM preflight WHERE run_id = 'run-bad' AND check_name LIKE 'host_memory@%'"
        ).fetchall()
    assert found == [(f"host_memory@{node}", "fail")]

    # The run's next training job keeps off it: the stage adopts the workspace's list (as the
    # pretrain step does before it launches) and its sbatch script excludes the node.
    stage = ws.path / "pretrain" / "0123456789ab"
    train = slurm_launch()
    assert adopt_excluded(stage, ws.root, train.max_excluded_nodes, lambda _: None) == [node]
    script = get_launcher(train).render(stage / "spec.json", stage)
    assert f"#SBATCH --exclude={node}" in script.splitlines()
