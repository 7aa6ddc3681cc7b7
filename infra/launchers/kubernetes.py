"""Kubernetes launcher: a Kubeflow training-operator PyTorchJob, applied and watched with kubectl.

One Master and `nodes - 1` Worker pods, each running one torchrun with `procs_per_node` ranks. The
operator injects the rendezvous (`PET_NNODES`, `PET_NODE_RANK`, `PET_MASTER_ADDR`,
`PET_MASTER_PORT`), which torchrun reads from the environment. The workspace is a shared
PersistentVolumeClaim mounted at the same path in every pod and in the Prefect worker's pod, so the
spec path and its out_dir mean the same thing everywhere; a restarted pod (`restartPolicy:
OnFailure`) reruns the same spec and the trainer resumes from its newest complete checkpoint.
S3 credentials come from a pod identity (`service_account`) or a Secret's keys as env vars, never
from the config. With `accelerate_config` each pod runs `accelerate launch --config_file FILE`
instead, its machine rank and rendezvous taken from the same operator variables in a shell.

The job's name is derived from the spec path, so a PyTorchJob of that name that exists before
`apply` is a leftover of a launch whose flow process died without deleting it (a cancelled or
failed wait deletes it). It is deleted (foreground: its pods first) before the new one is applied,
unless `launch/kubernetes-job.json` names an owner that is still alive on this host.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from infra.launchers.base import (
    LAUNCHERS,
    FirstError,
    JobRecord,
    Launcher,
    LaunchFailed,
    LogFn,
    OnStart,
    TorchrunSummary,
    accelerate_args,
    check_spec,
    failure_facts,
)

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)


@LAUNCHERS.register("kubernetes")
class KubernetesLauncher(Launcher):
    """PyTorchJob (kubeflow.org/v1); `runner` runs kubectl (a fake in unit tests)."""

    def __init__(self, config, runner: Runner = _run, sleep: Callable[[float], None] = time.sleep):
        super().__init__(config)
        self.runner, self.sleep = runner, sleep

    def job_name(self, spec_path: Path) -> str:
        digest = hashlib.sha256(str(Path(spec_path).resolve()).encode()).hexdigest()[:8]
        base = re.sub(r"[^a-z0-9-]", "-", self.config.kubernetes.job_name.lower()).strip("-")
        return f"{base[:40]}-{digest}"

    def manifest(self, spec_path: Path) -> dict[str, Any]:
        c, k = self.config, self.config.kubernetes
        spec = Path(spec_path)
        if k.workspace_claim and not spec.is_relative_to(k.workspace_mount):
            raise ValueError(
                f"stage spec {spec} is not under kubernetes.workspace_mount {k.workspace_mount}: "
                "pods only see the shared claim; write the workspace there"
            )
        limits: dict[str, Any] = {}
        if c.gpus_per_node:
            limits[k.gpu_resource] = c.gpus_per_node
        if k.cpu:
            limits["cpu"] = k.cpu
        if k.memory:
            limits["memory"] = k.memory
        env = [{"name": n, "value": v} for n, v in sorted(({"OMP_NUM_THREADS": "1"} | c.env).items())]
        env.append({"name": "PYTHONPATH", "value": k.code_dir})
        container: dict[str, Any] = {
            "name": "pytorch",  # the operator requires this container name
            "image": k.image,
            "workingDir": k.code_dir,
            "command": [c.torchrun],
            "args": [f"--nproc-per-node={c.procs_per_node}", "--max-restarts=0", "-m", c.module, str(spec)],
            **(self._accelerate(spec) if c.accelerate_config else {}),
            "env": env,
            "resources": {"limits": limits, "requests": dict(limits)} if limits else {},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL needs shared memory
        }
        volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        if k.workspace_claim:
            container["volumeMounts"].append({"name": "workspace", "mountPath": k.workspace_mount})
            volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": k.workspace_claim}})
        if k.credentials_secret:
            container["envFrom"] = [{"secretRef": {"name": k.credentials_secret}}]
        pod: dict[str, Any] = {"containers": [container], "volumes": volumes}
        if k.service_account:
            pod["serviceAccountName"] = k.service_account
        if k.node_selector:
            pod["nodeSelector"] = dict(k.node_selector)

        def replica(n: int) -> dict[str, Any]:
            return {"replicas": n, "restartPolicy": "OnFailure", "template": {"spec": copy.deepcopy(pod)}}

        replicas = {"Master": replica(1)}
        if c.nodes > 1:
            replicas["Worker"] = replica(c.nodes - 1)
        return {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {
                "name": self.job_name(spec),
                "namespace": k.namespace,
                "labels": {"app.kubernetes.io/part-of": "smollm3-pipeline"},
            },
            "spec": {
                "nprocPerNode": str(c.procs_per_node),
                "runPolicy": {"backoffLimit": 10, "cleanPodPolicy": "None"},
                "pytorchReplicaSpecs": replicas,
            },
        }

    def _accelerate(self, spec: Path) -> dict[str, Any]:
        """The container command for `accelerate launch`: accelerate reads no PET_* variables,
        so a shell passes the operator's node rank and master address to it."""
        c = self.config
        run = (
            shlex.join([c.accelerate, *accelerate_args(c)]) + ' --machine_rank "${PET_NODE_RANK:-${RANK:-0}}"'
            ' --main_process_ip "${PET_MASTER_ADDR:-${MASTER_ADDR:-127.0.0.1}}"'
            ' --main_process_port "${PET_MASTER_PORT:-${MASTER_PORT:-29500}}" '
            + shlex.join(["-m", c.module, str(spec)])
        )
        return {"command": ["bash", "-c"], "args": ["exec " + run]}

    def render(self, spec_path: Path, workdir: Path) -> str:
        return yaml.safe_dump(self.manifest(Path(spec_path)), sort_keys=False)

    def _kubectl(self, *args: str) -> subprocess.CompletedProcess:
        try:
            return self.runner(["kubectl", *args])
        except FileNotFoundError:
            raise LaunchFailed(
                "kubectl not found: launch.kind is kubernetes but this machine has "
                "no kubectl; run the flow in the kubernetes work pool"
            ) from None

    def status(self, name: str) -> str:
        ns = self.config.kubernetes.namespace
        proc = self._kubectl("get", "pytorchjob", name, "-n", ns, "-o", "json")
        if proc.returncode != 0:
            raise LaunchFailed(f"kubectl get pytorchjob {name} -n {ns} failed: {proc.stderr.strip()}")
        conditions = json.loads(proc.stdout).get("status", {}).get("conditions", [])
        true = [cond["type"] for cond in conditions if cond.get("status") == "True"]
        return true[-1] if true else "Created"

    def sweep(self, name: str, workdir: Path, log: LogFn = print) -> None:
        """Delete a leftover PyTorchJob of this stage (and its pods) before a new one is applied."""
        ns = self.config.kubernetes.namespace
        if self._kubectl("get", "pytorchjob", name, "-n", ns, "-o", "name").returncode != 0:
            return  # none there (kubectl says NotFound)
        owner = JobRecord(workdir, "kubernetes-job.json").live_owner()
        if owner is not None:
            raise LaunchFailed(
                f"PyTorchJob {ns}/{name} of stage folder {workdir} was applied by "
                f"{owner.describe()}, which is still running; wait for it, or "
                f"`kubectl delete pytorchjob {name} -n {ns}`"
            )
        log(f"[launch] PyTorchJob {ns}/{name} is left from an earlier launch: deleting it first")
        proc = self._kubectl(
            "delete", "pytorchjob", name, "-n", ns, "--cascade=foreground", "--wait=true", "--timeout=600s"
        )
        if proc.returncode != 0:
            raise LaunchFailed(f"could not delete leftover PyTorchJob {ns}/{name}: {proc.stderr.strip()}")

    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        spec_path = check_spec(spec_path)
        workdir = Path(workdir)
        manifest = workdir / "launch" / "pytorchjob.yaml"
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(self.render(spec_path, workdir))
        name, ns = self.job_name(spec_path), self.config.kubernetes.namespace
        self.sweep(name, workdir, log)
        record = JobRecord(workdir, "kubernetes-job.json")
        proc = self._kubectl("apply", "-f", str(manifest))
        if proc.returncode != 0:
            raise LaunchFailed(f"kubectl apply -f {manifest} failed: {proc.stderr.strip()}")
        record.write(f"{ns}/{name}")
        log(f"[launch] applied PyTorchJob {ns}/{name}")
        if on_start is not None:
            on_start(0)
        try:
            while (state := self.status(name)) not in {"Succeeded", "Failed"}:
                self.sleep(self.config.kubernetes.poll_seconds)
        except BaseException:
            self._kubectl("delete", "pytorchjob", name, "-n", ns, "--wait=false")
            raise
        record.clear()
        logs = self._kubectl("logs", "-n", ns, f"{name}-master-0", "--tail=200").stdout or ""
        tail = logs.splitlines()
        first, summary = FirstError(), TorchrunSummary()
        for line in tail:
            first.feed(line)
            summary.feed(line)
            log(line)
        if state != "Succeeded":
            facts = failure_facts(spec_path, workdir, summary, first, who=f"PyTorchJob {name}", state=state)
            raise LaunchFailed(
                f"PyTorchJob {ns}/{name} failed; see "
                f"{shlex.join(['kubectl', 'describe', 'pytorchjob', name, '-n', ns])}",
                tail[-40:],
                first.line,
                facts,
            )
        log(f"[launch] PyTorchJob {ns}/{name} succeeded")
