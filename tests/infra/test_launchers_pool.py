"""Helper pools beside a training job (infra/launchers/pool.py; SAO's rollout pool): what each
launcher renders, and `PoolRunner` keeping a real pool of processes running.

Rendering: the Slurm pool script parses, asks for the pool's nodes with one task each, is never
requeued by Slurm, and its task command (run by bash with the environment srun gives task 1)
calls the pool with node index 1; the Kubernetes pool is a batch/v1 Indexed Job whose pod
template is valid against the Kubernetes models (tests/infra/schemas) and whose command, with
Kubernetes' `$(VAR)` expansion applied, gives each pod its completion index. Running: the local
launcher's pool node (the real `trainers.posttrain.rollout pool`, waiting for a trainer that never
comes) is SIGKILLed from outside; the runner resubmits it, records it, and stops it at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import psutil
import pytest
import yaml

from infra.launchers import KubernetesLaunchConfig, LaunchConfig, SlurmLaunchConfig, get_launcher
from infra.launchers.pool import NODE, PoolRunner, PoolSpec, read_pool_record
from trainers.posttrain.launch import rollout_pool
from trainers.posttrain.sections import SAOConfig

STEP = Path("/fsx/ws/sao/ab12cd34ef56")


def _pool(folder: Path = STEP, nodes: int = 2, workers: int = 3) -> PoolSpec:
    pool = rollout_pool(SAOConfig(enabled=True, rollout_nodes=nodes, rollout_workers=workers), folder)
    assert pool is not None
    return pool


def test_the_rollout_pool_is_asked_for_only_with_rollout_nodes():
    assert rollout_pool(SAOConfig(enabled=True), STEP) is None
    pool = _pool()
    assert (pool.name, pool.nodes, pool.module) == ("rollout", 2, "trainers.posttrain.rollout")
    assert pool.argv("python", "7") == [
        "python",
        *("-m", "trainers.posttrain.rollout", "pool", str(STEP / "rollout")),
        *("--node", "7", "--nodes", "2", "--procs", "3"),
    ]
    assert NODE in pool.args


SLURM = LaunchConfig(
    kind="slurm",
    module="trainers.posttrain",
    python="/opt/venv/bin/python",
    code_dir="/fsx/code",
    env={"HF_HOME": "/fsx/hf"},
    slurm=SlurmLaunchConfig(
        partition="hopper-prod", account="smol", time="48:00:00", mem="1800G", setup=("source /fsx/venv/bin/activate",)
    ),
)


def test_the_slurm_pool_is_a_job_of_its_own_whose_tasks_run_the_pool_with_their_index(tmp_path):
    script = get_launcher(SLURM).render_pool(_pool(), STEP)
    path = tmp_path / "rollout.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    sb = {
        k: v or None
        for k, _, v in (line[10:].partition("=") for line in script.splitlines() if line.startswith("#SBATCH --"))
    }
    assert sb["nodes"] == "2" and sb["ntasks-per-node"] == "1" and sb["job-name"] == "smollm3-rollout"
    assert sb["partition"] == "hopper-prod" and sb["account"] == "smol" and sb["time"] == "48:00:00"
    assert sb["mem"] == "1800G" and sb["chdir"] == "/fsx/code" and sb["output"] == f"{STEP}/rollout-%j.log"
    assert "no-requeue" in sb and "requeue" not in sb  # the step's launch resubmits it, not Slurm
    assert "source /fsx/venv/bin/activate" in script and "export HF_HOME=/fsx/hf" in script
    # the task's command, as the task's own shell runs it: srun sets SLURM_PROCID per task
    (srun,) = [i for i, line in enumerate(script.splitlines()) if line.startswith("srun ")]
    inner = script.splitlines()[srun + 1].strip()
    assert inner.startswith("bash -c ")
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    line = inner.replace("/opt/venv/bin/python", str(fake))
    got = subprocess.run(
        ["bash", "-c", line], env={"SLURM_PROCID": "1", "PATH": os.environ["PATH"]}, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [
        *("-m", "trainers.posttrain.rollout", "pool", str(STEP / "rollout")),
        *("--node", "1", "--nodes", "2", "--procs", "3"),
    ]


K8S = LaunchConfig(
    kind="kubernetes",
    module="trainers.posttrain",
    gpus_per_node=8,
    python="/app/.venv/bin/python",
    env={"HF_HOME": "/fsx/hf"},
    kubernetes=KubernetesLaunchConfig(
        image="registry.example/smollm3:1.0",
        namespace="training",
        workspace_claim="fsx-workspace",
        workspace_mount="/fsx/ws",
        service_account="s3-writer",
        cpu="96",
        memory="1800Gi",
        gang="kueue",
        queue="team-a",
        node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"},
    ),
)


def test_the_kubernetes_pool_is_an_indexed_job_whose_pods_run_the_pool_with_their_index():
    launcher = get_launcher(K8S)
    job = yaml.safe_load(launcher.render_pool(_pool(), STEP))
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["metadata"]["namespace"] == "training" and job["metadata"]["name"].startswith("smollm3-rollout-")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # Kueue admits Jobs too
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    template = spec["template"]
    schema = json.loads((Path(__file__).parent / "schemas" / "pytorchjob-v1.schema.json").read_text())
    jsonschema.validate(template, {**schema, "$ref": "#/$defs/V1PodTemplateSpec"})  # the Kubernetes pod model
    pod = template["spec"]
    assert pod["restartPolicy"] == "OnFailure" and pod["serviceAccountName"] == "s3-writer"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/smollm3:1.0" and "args" not in container
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1800Gi"}
    assert {"name": "workspace", "mountPath": "/fsx/ws"} in container["volumeMounts"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["POOL_NODE"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env["HF_HOME"] == "/fsx/hf" and env["PYTHONPATH"] == "/app"
    # Kubernetes expands $(VAR) in command from the container's env: pod 1 of 2
    command = [re.sub(r"\$\((\w+)\)", lambda m: {"POOL_NODE": "1"}[m.group(1)], a) for a in container["command"]]
    assert command == [
        "/app/.venv/bin/python",
        *("-m", "trainers.posttrain.rollout", "pool", str(STEP / "rollout")),
        *("--node", "1", "--nodes", "2", "--procs", "3"),
    ]
    with pytest.raises(ValueError, match="not under kubernetes.workspace_mount /fsx/ws"):
        launcher.render_pool(_pool(), Path("/elsewhere/sao/x"))


def test_the_local_pool_is_one_command_per_node():
    lines = get_launcher(LaunchConfig(module="trainers.posttrain")).render_pool(_pool(nodes=2), STEP).splitlines()
    assert len(lines) == 2
    assert lines[1] == (
        f"{sys.executable} -m trainers.posttrain.rollout pool {STEP / 'rollout'} --node 1 --nodes 2 --procs 3"
    )


def _wait(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_pool_that_dies_while_the_trainer_runs_is_resubmitted_and_stopped_at_the_end(tmp_path):
    """The real pool node, waiting for a trainer that never prepares the folder, SIGKILLed by pid."""
    lines: list[str] = []
    launcher = get_launcher(LaunchConfig(module="trainers.posttrain"))
    pool = _pool(tmp_path, nodes=1, workers=1)
    with PoolRunner(launcher, pool, tmp_path, lines.append, poll_s=0.1) as runner:
        first = read_pool_record(tmp_path, "rollout")
        assert first["describe"] == f"local rollout pool (1 process, pid {first['job']})" and first["restarts"] == 0
        node = psutil.Process(int(first["job"]))
        assert "pool" in node.cmdline() and node.ppid() == os.getpid()  # a process of its own, not the trainer's
        os.kill(node.pid, signal.SIGKILL)
        _wait(lambda: (read_pool_record(tmp_path, "rollout") or {}).get("restarts") == 1, what="the resubmission")
        second = read_pool_record(tmp_path, "rollout")
        assert second["job"] != first["job"] and runner.restarts == 1
        again = psutil.Process(int(second["job"]))
        assert again.is_running() and "pool" in again.cmdline()
    assert any(
        f"pid {first['job']}) ended: node 0 (pid {first['job']}) killed by signal 9" in line for line in lines
    ), lines
    _wait(lambda: not again.is_running(), timeout=20, what="the pool to stop")  # stopped with the launch
    assert read_pool_record(tmp_path, "rollout") is None
