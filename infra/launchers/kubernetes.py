"""Kubernetes launcher: a Kubeflow training-operator PyTorchJob, applied and watched with kubectl.

One pod per node, each running one torchrun with `procs_per_node` ranks; the workspace is a shared
PersistentVolumeClaim mounted at the same path in every pod and in the Prefect worker's pod, so the
spec path and its out_dir mean the same thing everywhere, and every restart reruns the same spec:
the trainer resumes from its newest complete checkpoint. How a failure restarts (`restart`):

- "elastic" (default): `nodes` Worker pods under the operator's `elasticPolicy` (c10d rendezvous
  at worker-0, min = max = nodes, `PET_RDZV_*` injected by the operator), pods `OnFailure`, and
  torchrun `--max-restarts=max_restarts`: when one pod dies and restarts, every other node's
  torchrun sees its ranks fail, restarts them and they all meet the restarted pod in a new
  rendezvous round, so a lone restarted pod never waits for peers that moved on;
- "job": a Master and `nodes - 1` Workers with the static rendezvous the operator injects
  (`PET_MASTER_ADDR`...), pods `Never` restarted and `backoffLimit: 0`: the first failed pod
  fails the whole job (its survivors are deleted: cleanPodPolicy Running) and the step's retry
  applies it again.

Gang scheduling (`gang`), on by default for a multi-pod job ("auto": Volcano, which needs no queue
to be named; a one-pod job is whole anyway): "volcano" sets `schedulerName: volcano` and the
runPolicy's `schedulingPolicy.minAvailable = nodes` (the operator creates the PodGroup when started
with `--gang-scheduler-name=volcano`), "kueue" labels the job with its LocalQueue (Kueue admits all
its pods or none), "none" leaves the default scheduler, which may start some pods and leave them
waiting on the rest. The image must be pinned (a tag other than `latest`, or a digest), the
workspace claim named, and on an RDMA fabric (`launch.fabric.kind` efa or infiniband) every pod
requests the fabric's devices (`fabric_resource`, `fabric_devices`) with the IPC_LOCK capability
that registering RDMA memory needs. Memory and CPUs per pod are the stage plan's where the recipe
sets none (`LaunchConfig.sized`).
Eviction sends SIGTERM to torchrun, which forwards it to the ranks; they save their step
(trainers/rank_signals.py) well within `terminationGracePeriodSeconds` (`termination_grace_s`, checked
to exceed `launch.rendezvous.stop_grace_s`). Fabric, NCCL and rendezvous settings and rank labels
as for every launcher (infra/launchers/fabric.py). S3 credentials come from a pod identity
(`service_account`) or a Secret's keys as env vars, never from the config. With
`accelerate_config` each pod runs `accelerate launch --config_file FILE` instead, its machine rank
and rendezvous taken from the operator's static variables in a shell (so such a job restarts as
"job": accelerate takes no elastic rendezvous).

The job's name is derived from the spec path. A PyTorchJob of that name that exists before
`apply` was applied by a launch whose flow process died: when `launch/kubernetes-job.json` says
it runs the same manifest and spec and it has not failed, this launch re-attaches to it (waits for
its end, applies nothing); otherwise it is deleted (foreground: its pods first) and the new one
applied (`kubectl apply -f -`: the manifest rendered in memory goes on stdin, so a copy of
`launch/pytorchjob.yaml` swapped after it was written is never what is applied). It refuses
while the recorded owner is still alive on this host.

While it waits, the launcher watches the job's pods (`LostPods`): a pod lost with its node (the
pod's own DisruptionTarget, NodeLost or node-shutdown status, or a failed, stuck or vanished pod
whose Node is NotReady or gone) names that node (its `spec.nodeName`), which is excluded from the
stage's next attempts at once (infra/launchers/exclude.py) and named in a failed job's cause; a pod
that failed from its own code on a Ready node names none. Only an explicit
cancellation (Ctrl-C, a cancelled Prefect run: infra/launchers/follow.py) deletes a job being
waited for.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from infra.launchers.base import (
    LAUNCHERS,
    NODE_ENV,
    FailureFacts,
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
    launch_digest,
    stage_progress,
)
from infra.launchers.exclude import exclude_node, excluded_nodes
from infra.launchers.fabric import launch_env, torchrun_flags
from infra.launchers.follow import explicit_stop, following
from infra.launchers.peers import LostPeer

Runner = Callable[..., subprocess.CompletedProcess]  # runner(cmd) or runner(cmd, input=text)
RECORD = "kubernetes-job.json"  # launch/kubernetes-job.json (base.py JobRecord)
JOB_LABEL = "training.kubeflow.org/job-name"  # the training operator's label on every pod of a job

# Kubernetes' own words for a pod lost with its node, not to its code
# (kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions): the
# DisruptionTarget reasons of a pod deleted for its node (the taint manager's NoExecute eviction
# from a not-ready or unreachable node; pod garbage collection of a pod whose Node object is gone),
# and the pod `status.reason`s of a node lost or shutting down (the node controller's NodeLost; the
# kubelet's graceful node shutdown, Terminated, Shutdown before 1.22; NodeShutdown: refused by a
# node shutting down). TerminationByKubelet alone is not one: node-pressure eviction sets it too,
# and a pod's own memory can cause that.
NODE_DISRUPTIONS = ("DeletionByTaintManager", "DeletionByPodGC")
NODE_POD_REASONS = ("NodeLost", "Terminated", "Shutdown", "NodeShutdown")
# the taints the node lifecycle controller puts on a node whose kubelet stopped reporting
NOT_READY_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def _run(cmd: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=120)


def _said(what: str, message: object) -> str:
    text = " ".join(str(message or "").split())[:200]
    return f"{what}: {text}" if text else what


def pod_lost_with_node(pod: dict) -> str | None:
    """What a pod's own status says of losing its node (`DisruptionTarget DeletionByTaintManager:
    Taint manager: deleting due to NoExecute taint`); None when it says nothing of the kind."""
    status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
    for cond in status.get("conditions") or ():
        if (
            isinstance(cond, dict)
            and cond.get("type") == "DisruptionTarget"
            and cond.get("status") == "True"
            and cond.get("reason") in NODE_DISRUPTIONS
        ):
            return _said(f"DisruptionTarget {cond['reason']}", cond.get("message"))
    if status.get("reason") in NODE_POD_REASONS:
        return _said(str(status["reason"]), status.get("message"))
    return None


def node_out_of_service(node: dict) -> str | None:
    """What a Node object says of being out of service (`NotReady (NodeStatusUnknown: Kubelet
    stopped posting node status.)`, or a not-ready/unreachable taint); None when it is Ready."""
    status = node.get("status") if isinstance(node.get("status"), dict) else {}
    ready = next((c for c in status.get("conditions") or () if isinstance(c, dict) and c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") != "True":
        why = ready.get("reason") or f"Ready={ready.get('status')}"
        return f"NotReady ({_said(str(why), ready.get('message'))})"
    spec = node.get("spec") if isinstance(node.get("spec"), dict) else {}
    for taint in spec.get("taints") or ():
        if isinstance(taint, dict) and taint.get("key") in NOT_READY_TAINTS:
            return f"tainted {taint['key']}:{taint.get('effect', '')}"
    return None


class LostPods:
    """Follows the pods of one PyTorchJob over the polls and names the nodes it lost pods with.

    Each poll lists the job's pods (`kubectl get pods -l training.kubeflow.org/job-name=NAME`) and
    remembers each pod's node (`spec.nodeName`). A pod is lost with its node when its own status
    says so (`pod_lost_with_node`), or when it failed, is stuck terminating, is phase Unknown,
    vanished (deleted, or replaced by the operator) or, once the job failed, did not succeed, and
    its node is out of service (`node_out_of_service`, `kubectl get node`; a node object that is
    gone counts). A pod that failed from its own code on a Ready node names no node. A failed or vanished pod is judged
    once; one stuck terminating or Unknown again at every poll (the node controller marks a node
    NotReady about 40 s after its kubelet stops reporting). `lost`: node -> what was seen, in
    the order found."""

    def __init__(self, kubectl: Callable[..., subprocess.CompletedProcess], name: str, namespace: str):
        self.kubectl, self.name, self.namespace = kubectl, name, namespace
        self.pods: dict[str, tuple[str, str]] = {}  # uid -> (pod name, node) of every pod seen placed
        self.judged: set[str] = set()  # uids whose fate is settled
        self.lost: dict[str, str] = {}

    def poll(self, final: bool = False) -> list[str]:
        """Look at the job's pods once; the nodes found lost in this poll. `final` (the job
        failed): every placed pod that did not succeed has its node looked at too, since a node
        that died less than the taint manager's 300 s before leaves its pod Running, unmarked."""
        proc = self.kubectl("get", "pods", "-n", self.namespace, "-l", f"{JOB_LABEL}={self.name}", "-o", "json")
        if proc.returncode != 0:
            return []  # the API did not answer: the next poll looks again
        try:
            items = json.loads(proc.stdout or "{}").get("items")
        except (ValueError, AttributeError):
            return []
        pods = [p for p in items if isinstance(p, dict)] if isinstance(items, list) else []
        nodes: dict[str, str | None] = {}  # this poll's node answers
        found: list[str] = []
        present: set[str] = set()
        for pod in pods:
            meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
            spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
            uid, name, node = str(meta.get("uid") or meta.get("name")), str(meta.get("name")), spec.get("nodeName")
            if not isinstance(node, str) or not node:
                continue  # not placed yet
            present.add(uid)
            self.pods[uid] = (name, node)
            if uid in self.judged or node in self.lost:
                continue
            why = pod_lost_with_node(pod)
            phase = (pod.get("status") or {}).get("phase") if isinstance(pod.get("status"), dict) else None
            stuck = bool(meta.get("deletionTimestamp")) or phase == "Unknown"
            if why is None and (stuck or phase == "Failed" or (final and phase != "Succeeded")):
                why = self._node(node, nodes)
                if phase == "Failed" and not stuck:
                    self.judged.add(uid)  # its end is written: judged once
            if why is not None:
                self.judged.add(uid)
                found.append(self._lose(name, node, why))
        for uid, (name, node) in self.pods.items():
            if uid in present or uid in self.judged:
                continue
            self.judged.add(uid)  # vanished: deleted, or replaced by the operator
            if node not in self.lost and (why := self._node(node, nodes)) is not None:
                found.append(self._lose(name, node, why))
        return found

    def _lose(self, pod: str, node: str, why: str) -> str:
        self.lost[node] = f"pod {pod} lost with its node {node} ({why})"
        return node

    def _node(self, node: str, seen: dict[str, str | None]) -> str | None:
        """Why `node` is out of service (None: Ready, or the API did not say)."""
        if node not in seen:
            proc = self.kubectl("get", "node", node, "-o", "json")
            if proc.returncode != 0:
                gone = "NotFound" in (proc.stderr or "") or "not found" in (proc.stderr or "")
                seen[node] = "node object gone (NotFound)" if gone else None
            else:
                try:
                    seen[node] = node_out_of_service(json.loads(proc.stdout or "{}"))
                except (ValueError, AttributeError):
                    seen[node] = None
        return seen[node]


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

    def manifest(self, spec_path: Path, workdir: Path | None = None) -> dict[str, Any]:
        """The PyTorchJob; `workdir` (default: the spec's folder) holds the nodes to avoid."""
        c, k = self.config, self.config.kubernetes
        spec = Path(spec_path)
        if k.workspace_claim and not spec.is_relative_to(k.workspace_mount):
            raise ValueError(
                f"stage spec {spec} is not under kubernetes.workspace_mount {k.workspace_mount}: "
                "pods only see the shared claim; write the workspace there"
            )
        limits: dict[str, Any] = {}
        if c.gpus_per_node:
            limits[k.gpu_resource] = str(c.gpus_per_node)  # a quantity: Kubernetes takes strings
        if k.cpu:
            limits["cpu"] = k.cpu
        if k.memory:
            limits["memory"] = k.memory
        rdma = k.rdma(c.fabric.kind)
        if rdma is not None:  # the fabric's devices in the pod: RDMA needs them and locked memory
            limits[rdma[0]] = str(rdma[1])
        labels = not c.accelerate_config  # accelerate prints progress marks that must stay unlabelled
        env_vars = {"OMP_NUM_THREADS": "1"} | launch_env(c.fabric, c.rendezvous, labels=labels) | dict(c.env)
        env = [{"name": n, "value": v} for n, v in sorted(env_vars.items())]
        env.append({"name": "PYTHONPATH", "value": k.code_dir})
        # the node's name (not the pod's) in heartbeats and hang reports: what an anti-affinity excludes
        env.append({"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        elastic = self.elastic
        restarts = k.max_restarts if elastic else 0
        log_dir = str(spec.parent / "logs" / "ranks") if labels else None
        args = [
            f"--nproc-per-node={c.procs_per_node}",
            *torchrun_flags(c.rendezvous, log_dir, rendezvous=elastic),
            f"--max-restarts={restarts}",
            "-m",
            c.module,
            str(spec),
        ]
        container: dict[str, Any] = {
            "name": "pytorch",  # the operator requires this container name
            "image": k.image,
            "workingDir": k.code_dir,
            "command": [c.torchrun],
            "args": args,
            **(self._accelerate(spec) if c.accelerate_config else {}),
            "env": env,
            "resources": {"limits": limits, "requests": dict(limits)} if limits else {},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL needs shared memory
        }
        if rdma is not None:  # registering RDMA memory pins it: the container may lock memory
            container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        if k.workspace_claim:
            container["volumeMounts"].append({"name": "workspace", "mountPath": k.workspace_mount})
            volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": k.workspace_claim}})
        if k.credentials_secret:
            container["envFrom"] = [{"secretRef": {"name": k.credentials_secret}}]
        # Eviction sends SIGTERM to torchrun, which forwards it; the ranks save their step within
        # rendezvous.stop_grace_s, well before the kubelet's SIGKILL (trainers/rank_signals.py).
        pod: dict[str, Any] = {
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": k.termination_grace_s,
        }
        if k.service_account:
            pod["serviceAccountName"] = k.service_account
        if k.node_selector:
            pod["nodeSelector"] = dict(k.node_selector)
        if excluded := excluded_nodes(Path(workdir) if workdir is not None else spec.parent):
            # nodes earlier attempts failed on (infra/launchers/exclude.py): no pod is placed there
            term = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": excluded}
            pod["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [term]}]
                    }
                }
            }
        gang = k.gang_for(c.nodes)
        if gang == "volcano":
            pod["schedulerName"] = "volcano"

        def replica(n: int) -> dict[str, Any]:
            policy = "OnFailure" if elastic else "Never"  # job: a failed pod fails the job whole
            return {"replicas": n, "restartPolicy": policy, "template": {"spec": copy.deepcopy(pod)}}

        if elastic:  # every pod a Worker: the operator points the c10d rendezvous at worker-0
            replicas = {"Worker": replica(c.nodes)}
        else:
            replicas = {"Master": replica(1)}
            if c.nodes > 1:
                replicas["Worker"] = replica(c.nodes - 1)
        run_policy: dict[str, Any] = {
            "backoffLimit": 10 if elastic else 0,
            "cleanPodPolicy": "None" if elastic else "Running",  # job: a failed job's survivors go
        }
        if gang == "volcano":
            run_policy["schedulingPolicy"] = {"minAvailable": c.nodes, **({"queue": k.queue} if k.queue else {})}
            if k.priority_class:
                run_policy["schedulingPolicy"]["priorityClass"] = k.priority_class
        metadata_labels = {"app.kubernetes.io/part-of": "smollm3-pipeline"}
        if gang == "kueue":
            metadata_labels["kueue.x-k8s.io/queue-name"] = str(k.queue)
            if k.priority_class:
                metadata_labels["kueue.x-k8s.io/priority-class"] = k.priority_class
        job_spec: dict[str, Any] = {
            "nprocPerNode": str(c.procs_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replicas,
        }
        if elastic:
            job_spec["elasticPolicy"] = {
                "rdzvBackend": "c10d",
                "minReplicas": c.nodes,  # a fixed world: the global batch is divided by it
                "maxReplicas": c.nodes,
                "maxRestarts": k.max_restarts,
            }
        return {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": self.job_name(spec), "namespace": k.namespace, "labels": metadata_labels},
            "spec": job_spec,
        }

    @property
    def elastic(self) -> bool:
        """Elastic restarts; not with accelerate, which takes a static machine rank and address."""
        return self.config.kubernetes.restart == "elastic" and not self.config.accelerate_config

    def _exclude_lost(self, pods: LostPods, spec_path: Path, workdir: Path, log: LogFn, final: bool = False) -> None:
        """Look at the job's pods; a node it lost a pod with is excluded at once from the stage's
        next attempts (an elastic job may go on without it: its pod is recreated elsewhere)."""
        for node in pods.poll(final):
            log(f"[launch] {pods.lost[node]}")
            last_step, checkpoint_step = stage_progress(spec_path, workdir)
            facts = FailureFacts(
                who=f"PyTorchJob {pods.name}",
                node=node,
                node_lost=pods.lost[node],
                last_step=last_step,
                checkpoint_step=checkpoint_step,
            )
            exclude_node(workdir, facts, self.config.max_excluded_nodes, log)

    def leader_pod(self, name: str) -> str:
        """The pod whose log holds rank 0's lines (and the rendezvous store)."""
        return f"{name}-worker-0" if self.elastic else f"{name}-master-0"

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
        return yaml.safe_dump(self.manifest(Path(spec_path), Path(workdir)), sort_keys=False)

    # -- a helper pool beside the PyTorchJob (infra/launchers/pool.py) --

    def pool_name(self, pool, workdir: Path) -> str:
        digest = hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:8]
        base = re.sub(r"[^a-z0-9-]", "-", f"{self.config.kubernetes.job_name}-{pool.name}".lower()).strip("-")
        return f"{base[:40]}-{digest}"

    def pool_manifest(self, pool, workdir: Path) -> dict[str, Any]:
        """A second replica set beside the PyTorchJob: a batch/v1 Indexed Job of `pool.nodes`
        pods (completions = parallelism = nodes), each running the pool's command with its index
        (`$(POOL_NODE)`, from the Job's completion-index annotation). A PyTorchJob takes only
        Master and Worker replicas, which all join torchrun's rendezvous: the pool is not one.
        Same image, claim, code folder, environment, resources and node selector as the trainer's
        pods; a pod that fails restarts in place (OnFailure), a Job that fails is resubmitted by
        the step's launch while the trainer runs."""
        c, k = self.config, self.config.kubernetes
        if k.workspace_claim and not Path(workdir).is_relative_to(k.workspace_mount):
            raise ValueError(
                f"step folder {workdir} is not under kubernetes.workspace_mount {k.workspace_mount}: the "
                f"{pool.name} pool's pods only see the shared claim"
            )
        trainer = self.manifest(Path(workdir) / "spec.json", workdir)
        replica = next(iter(trainer["spec"]["pytorchReplicaSpecs"].values()))
        pod = copy.deepcopy(replica["template"]["spec"])
        container = pod["containers"][0]
        container["name"] = pool.name
        container["command"] = pool.argv(c.python, "$(POOL_NODE)")
        container.pop("args", None)
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        container["env"] = [{"name": "POOL_NODE", "valueFrom": {"fieldRef": {"fieldPath": index}}}, *container["env"]]
        pod["restartPolicy"] = "OnFailure"
        pod.pop("schedulerName", None)  # the pool's pods are independent: no gang to wait for
        labels = dict(trainer["metadata"]["labels"])
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": self.pool_name(pool, workdir), "namespace": k.namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed",
                "completions": pool.nodes,
                "parallelism": pool.nodes,
                "backoffLimit": 4 * pool.nodes,  # pod restarts in place before the Job counts as failed
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        }

    def render_pool(self, pool, workdir: Path) -> str:
        return yaml.safe_dump(self.pool_manifest(pool, Path(workdir)), sort_keys=False)

    def submit_pool(self, pool, workdir: Path, log: LogFn = print) -> str:
        """Apply the pool's Job (on stdin; `launch/{name}-job.yaml` for people to read), after
        deleting one an earlier launch of this step left."""
        name, ns = self.pool_name(pool, workdir), self.config.kubernetes.namespace
        text = self.render_pool(pool, workdir)
        copy_path = Path(workdir) / "launch" / f"{pool.name}-job.yaml"
        copy_path.parent.mkdir(parents=True, exist_ok=True)
        copy_path.write_text(text)
        gone = self._kubectl("delete", "job", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=600s")
        if gone.returncode != 0:
            raise LaunchFailed(f"could not delete the leftover {pool.name} pool Job {ns}/{name}: {gone.stderr.strip()}")
        proc = self._kubectl("apply", "-f", "-", input=text)
        if proc.returncode != 0:
            raise LaunchFailed(f"kubectl apply -f - ({copy_path}, from memory) failed: {proc.stderr.strip()}")
        return f"{ns}/{name}"

    def pool_state(self, pool, handle: str) -> str | None:
        ns, name = handle.split("/", 1)
        proc = self._kubectl("get", "job", name, "-n", ns, "-o", "json")
        if proc.returncode != 0:
            if "NotFound" in (proc.stderr or ""):
                return "is gone (deleted)"
            raise LaunchFailed(f"kubectl get job {name} -n {ns} failed: {proc.stderr.strip()}")
        conditions = json.loads(proc.stdout).get("status", {}).get("conditions", [])
        true = {cond["type"]: cond.get("reason", "") for cond in conditions if cond.get("status") == "True"}
        if "Complete" in true:
            return "completed"
        if "Failed" in true:
            return f"ended Failed ({true['Failed'] or 'no reason given'})"
        return None

    def cancel_pool(self, pool, handle: str, workdir: Path) -> None:
        ns, name = handle.split("/", 1)
        self._kubectl("delete", "job", name, "-n", ns, "--ignore-not-found", "--wait=false")

    def describe_pool(self, pool, handle: str) -> str:
        nodes = "1 pod" if pool.nodes == 1 else f"{pool.nodes} pods"
        return f"{pool.name} pool Job {handle} ({nodes}; `kubectl logs -n {handle.split('/')[0]} job/{handle.split('/')[1]}`)"

    def _kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        try:
            return self.runner(["kubectl", *args]) if input is None else self.runner(["kubectl", *args], input=input)
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

    def reattach(self, name: str, workdir: Path, digest: str, log: LogFn = print) -> bool:
        """Whether a PyTorchJob of this stage that an earlier launch applied is followed again
        (it runs the same manifest and spec, and has not failed); one that does not is deleted
        (foreground: its pods first) so the new one can be applied. Refuses while the recorded
        owner is still alive on this host."""
        ns = self.config.kubernetes.namespace
        if self._kubectl("get", "pytorchjob", name, "-n", ns, "-o", "name").returncode != 0:
            return False  # none there (kubectl says NotFound)
        record = JobRecord(workdir, RECORD)
        owner = record.live_owner()
        if owner is not None:
            raise LaunchFailed(
                f"PyTorchJob {ns}/{name} of stage folder {workdir} was applied by "
                f"{owner.describe()}, which is still running; wait for it, or "
                f"`kubectl delete pytorchjob {name} -n {ns}`"
            )
        state = self.status(name)
        if record.digest == digest and state != "Failed":
            record.attach()
            log(
                f"[launch] re-attaching to PyTorchJob {ns}/{name} ({state}), applied by a launch that is gone; "
                "waiting for its end, applying nothing"
            )
            return True
        log(f"[launch] PyTorchJob {ns}/{name} is left from an earlier launch ({state}): deleting it first")
        proc = self._kubectl(
            "delete", "pytorchjob", name, "-n", ns, "--cascade=foreground", "--wait=true", "--timeout=600s"
        )
        if proc.returncode != 0:
            raise LaunchFailed(f"could not delete leftover PyTorchJob {ns}/{name}: {proc.stderr.strip()}")
        record.clear()
        return False

    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        spec_path = check_spec(spec_path)
        workdir = Path(workdir)
        manifest = workdir / "launch" / "pytorchjob.yaml"
        manifest.parent.mkdir(parents=True, exist_ok=True)
        text = self.render(spec_path, workdir)
        digest = launch_digest(text, spec_path)
        name, ns = self.job_name(spec_path), self.config.kubernetes.namespace
        record = JobRecord(workdir, RECORD)
        if not self.reattach(name, workdir, digest, log):
            manifest.write_text(text)  # for people to read: what is applied is `text`, on stdin
            proc = self._kubectl("apply", "-f", "-", input=text)
            if proc.returncode != 0:
                raise LaunchFailed(f"kubectl apply -f - ({manifest}, from memory) failed: {proc.stderr.strip()}")
            record.write(f"{ns}/{name}", digest)
            log(f"[launch] applied PyTorchJob {ns}/{name}")
        if on_start is not None:
            on_start(0)
        delete = ("delete", "pytorchjob", name, "-n", ns, "--wait=false")
        pods = LostPods(self._kubectl, name, ns)
        with following(f"PyTorchJob {ns}/{name}", lambda: self._kubectl(*delete)) as handle:
            try:
                while (state := self.status(name)) not in {"Succeeded", "Failed"}:
                    self._exclude_lost(pods, spec_path, workdir, log)
                    self.sleep(self.config.kubernetes.poll_seconds)
                    handle.check()
            except BaseException as exc:
                if explicit_stop(exc):
                    self._kubectl(*delete)
                else:
                    log(
                        f"[launch] stopped following PyTorchJob {ns}/{name} ({type(exc).__name__}); it keeps "
                        f"running: a retry of this step re-attaches to it, `kubectl delete pytorchjob {name} -n {ns}` "
                        "stops it"
                    )
                raise
        record.clear()
        logs = self._kubectl("logs", "-n", ns, self.leader_pod(name), "--tail=200").stdout or ""
        tail = logs.splitlines()
        first, summary, lost = FirstError(), TorchrunSummary(), LostPeer()
        for line in tail:
            first.feed(line)
            summary.feed(line)
            lost.feed(line)
            log(line)
        if state != "Succeeded":
            self._exclude_lost(pods, spec_path, workdir, log, final=True)  # what the failed job's pods say last
            facts = failure_facts(spec_path, workdir, summary, first, who=f"PyTorchJob {name}", state=state, lost=lost)
            if pods.lost:  # nodes the job lost pods with: the first is blamed unless a hang named one
                blamed = facts.node or next(iter(pods.lost))
                more = tuple(n for n in pods.lost if n != blamed)
                facts = replace(facts, node=blamed, more_nodes=more, node_lost="; ".join(pods.lost.values()))
            facts = exclude_node(workdir, facts, self.config.max_excluded_nodes, log)
            raise LaunchFailed(
                f"PyTorchJob {ns}/{name} failed; see "
                f"{shlex.join(['kubectl', 'describe', 'pytorchjob', name, '-n', ns])}",
                tail[-40:],
                first.line,
                facts,
            )
        log(f"[launch] PyTorchJob {ns}/{name} succeeded")
