"""Launches an HPC engineer accepts: strict PyTorchJob manifests, fabric settings, named lost peers.

- The PyTorchJobs the launcher renders (the 3B recipe's size, every gang and restart option,
  accelerate) validate against Kubeflow's PyTorchJob model (tests/infra/schemas: generated from
  the Kubeflow Training SDK and Kubernetes client models, every object closed to unknown fields)
  and obey the training operator's own rules for PyTorchJobs.
- Two torchrun "nodes" on this machine (c10d rendezvous, 1 CPU rank each, the real trainer, the
  launch's own flags): when one node is SIGKILLed, the survivor ends within seconds and its
  failure names what it lost: the peer's address, or the rendezvous store when the dead node
  hosted it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import psutil
import pytest
import yaml

from flows.recipe import load_recipe
from infra.launchers import KubernetesLaunchConfig, LaunchConfig, get_launcher
from infra.launchers.base import FirstError, TorchrunSummary, failure_facts
from infra.launchers.fabric import FabricConfig, RendezvousConfig, launch_env, torchrun_flags
from infra.launchers.peers import LostPeer
from pipeline.step import transient
from tests.infra.launch_fixtures import write_plan, write_spec

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "pytorchjob-v1.schema.json").read_text())
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def operator_rules(job: dict) -> list[str]:
    """What the training operator (v1.8/1.9) validates beyond the schema, or acts on by name."""
    problems = []
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if set(replicas) - {"Master", "Worker"}:
        problems.append(f"replica types {sorted(replicas)}: only Master and Worker")
    if "Master" in replicas and replicas["Master"]["replicas"] != 1:
        problems.append("exactly one Master")
    for kind, replica in replicas.items():
        if replica.get("restartPolicy") not in ("Always", "OnFailure", "Never", "ExitCode"):
            problems.append(f"{kind}: restartPolicy {replica.get('restartPolicy')}")
        names = [c["name"] for c in replica["template"]["spec"]["containers"]]
        if "pytorch" not in names:
            problems.append(f"{kind}: no container named pytorch")
    if spec["runPolicy"].get("cleanPodPolicy") not in (None, "All", "Running", "None"):
        problems.append("cleanPodPolicy")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if elastic.get("rdzvBackend") not in ("c10d", "etcd", "etcd-v2"):
            problems.append("rdzvBackend")
        if elastic["minReplicas"] > elastic["maxReplicas"]:
            problems.append("minReplicas > maxReplicas")
    return problems


def validate(job: dict) -> None:
    jsonschema.validate(job, SCHEMA)
    assert operator_rules(job) == []


def k8s_3b(**kubernetes) -> LaunchConfig:
    """The 3B recipe's launch (48 nodes x 8 H100, its training's ranks per node) on Kubernetes."""
    recipe = load_recipe("smollm3-3b")
    launch = recipe.launch
    k8s = KubernetesLaunchConfig(
        image="registry.example/smollm3:1.0", workspace_claim="fsx", workspace_mount="/fsx/ws", **kubernetes
    )
    return launch.model_copy(
        update={"kind": "kubernetes", "procs_per_node": recipe.training.nproc_per_node, "kubernetes": k8s}
    )


SPEC = Path("/fsx/ws/train/pretrain-1/spec.json")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"restart": "job"},
        {"gang": "kueue", "queue": "h100", "priority_class": "training"},
        {"gang": "volcano", "queue": "research", "priority_class": "high"},
        {"gang": "volcano", "restart": "job"},
    ],
    ids=["elastic", "whole-job", "kueue", "volcano", "volcano-whole-job"],
)
def test_the_3b_recipes_pytorchjob_validates_against_kubeflows_model(options, tmp_path):
    config = k8s_3b(**options)
    job = yaml.safe_load(get_launcher(config).render(SPEC, tmp_path))
    validate(job)
    pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert sum(r["replicas"] for r in job["spec"]["pytorchReplicaSpecs"].values()) == config.nodes
    assert all(p["terminationGracePeriodSeconds"] > config.rendezvous.stop_grace_s for p in pods)
    if options.get("gang") == "kueue":
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "h100"
    # the recipe's fabric (EFA): every pod asks for the devices and may lock memory for RDMA
    assert all(p["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32" for p in pods)
    assert all(p["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"] for p in pods)
    if options.get("gang", "volcano") == "volcano":  # volcano by default: 48 pods, all or none
        assert all(p["schedulerName"] == "volcano" for p in pods)
        assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == config.nodes


def test_an_accelerate_launch_validates_and_restarts_as_a_whole_job(tmp_path):
    config = k8s_3b().model_copy(
        update={"module": "trainers.posttrain", "accelerate_config": "configs/accelerate/fsdp.yaml", "nodes": 8}
    )
    job = yaml.safe_load(get_launcher(config).render(SPEC, tmp_path))
    validate(job)
    assert "elasticPolicy" not in job["spec"] and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}


def test_the_schema_is_strict_enough_to_catch_a_wrong_manifest(tmp_path):
    """The validation above can fail: an unknown pod field, a missing container name, a string
    where the model wants an integer are each refused."""
    job = yaml.safe_load(get_launcher(k8s_3b()).render(SPEC, tmp_path))
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    for mutate in (
        lambda p: p.__setitem__("terminationGracePeriod", 300),  # a typo of a real field
        lambda p: p["containers"][0].pop("name"),
        lambda p: p.__setitem__("terminationGracePeriodSeconds", "300"),
    ):
        broken = json.loads(json.dumps(job))
        mutate(broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)
    assert pod["containers"][0]["name"] == "pytorch"
    broken = json.loads(json.dumps(job))
    broken["spec"]["pytorchReplicaSpecs"]["Launcher"] = broken["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert operator_rules(broken)


def test_kubernetes_options_are_checked_with_the_field_named():
    with pytest.raises(ValueError, match="kubernetes.gang is kueue: name the LocalQueue"):
        KubernetesLaunchConfig(gang="kueue")
    with pytest.raises(ValueError, match=r"termination_grace_s \(100\) must exceed rendezvous.stop_grace_s \(180\)"):
        LaunchConfig(kind="kubernetes", kubernetes=KubernetesLaunchConfig(termination_grace_s=100))


def test_fabric_settings_render_with_sane_defaults_and_recipe_overrides(tmp_path):
    ib = FabricConfig(kind="infiniband", socket_ifname="^lo,docker", ib_hca="mlx5", ib_gid_index=3)
    env = launch_env(ib, RendezvousConfig(), labels=True)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "^lo,docker"
    assert (env["NCCL_IB_HCA"], env["NCCL_IB_GID_INDEX"], env["NCCL_IB_TIMEOUT"]) == ("mlx5", "3", "22")
    assert "FI_PROVIDER" not in env
    efa = launch_env(FabricConfig(kind="efa"), RendezvousConfig(), labels=False)
    assert (efa["FI_PROVIDER"], efa["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1")
    assert "NCCL_IB_HCA" not in efa and "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" not in efa
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "SMOLLM3_COLLECTIVE_TIMEOUT_S"):
        assert name in env and name in efa  # error handling and timeouts are always on
    # launch.env wins over the fabric's defaults in the rendered script
    config = LaunchConfig(kind="slurm", fabric=ib, env={"NCCL_IB_TIMEOUT": "20"})
    script = get_launcher(config).render(tmp_path / "spec.json", tmp_path).splitlines()
    assert "export NCCL_IB_TIMEOUT=20" in script and "export NCCL_IB_HCA=mlx5" in script


def test_a_lost_peer_is_named_in_the_cause_and_makes_the_failure_transient(tmp_path):
    out = tmp_path
    spec = write_spec(out / "spec.json", out / "plan.json", out)
    (out / "metrics.jsonl").write_text('{"step": 7}\n')
    lines = [
        "[launch] job 12 (restart 0) on 2 node(s) node-[0-1]; rendezvous node-0:29500",
        "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:45735. This is typically ...",
    ]
    first, summary, lost = FirstError(), TorchrunSummary(), LostPeer()
    for line in lines:
        first.feed(line)
        lost.feed(line)
    facts = failure_facts(spec, out, summary, first, returncode=1, who="Slurm job 12", state="FAILED", lost=lost)
    assert facts.lost == "peer 10.0.0.2:45735" and facts.external
    assert "having lost peer 10.0.0.2:45735: that node died or its network failed" in facts.cause()

    from infra.launchers import LaunchFailed

    assert transient(LaunchFailed("Slurm job 12 ended FAILED", lines, first.line, facts))
    store = LostPeer()
    store.feed(lines[0])
    store.feed(
        "[W1201 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3, addr=[::ffff:10.0.0.2]:35704, remote=[::ffff:10.0.0.1]:29500): Failed to recv, got 0 bytes."
    )  # noqa: E501
    assert (
        store.describe()
        == "the rendezvous store at 10.0.0.1:29500 = node-0:29500 (hosted by the first node's torchrun)"
    )
    nccl = LostPeer()
    nccl.feed("node-1:77:91 [3] NCCL WARN NET/Socket : socketProgress: Connection closed by remote peer node-0<45122>")
    assert nccl.describe() == "peer node-0:45122"


def _wait_listening(proc: subprocess.Popen, port: int, timeout: float = 120.0) -> None:
    """Until a process of `proc`'s tree listens on `port` (a fixed sleep lost the race on a loaded
    machine: the second node's torchrun bound the port first and hosted the store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the first node's torchrun exited"
        tree = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
        if any(
            c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid in tree
            for c in psutil.net_connections(kind="tcp")
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"the first node's torchrun did not listen on {port} in {timeout}s")


def _two_nodes(tmp_path: Path, victim: int) -> tuple[subprocess.Popen, Path, float]:
    """Start two torchrun nodes of one job, kill `victim` (its whole process group, as a node
    loss would) after 3 steps; return the survivor, its log, the time of the kill."""
    plan = write_plan(tmp_path / "shards")
    out = tmp_path / "stage"
    spec = write_spec(
        out / "spec.json",
        plan,
        out,
        steps=40,
        debug_step_sleep_s=0.3,
        checkpoint_interval=1000,
        schedule={"warmup_steps": 1, "total_steps": 40},
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = RendezvousConfig(join_timeout_s=120, read_timeout_s=30)
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env |= launch_env(FabricConfig(), rdzv, labels=True)
    nodes = []
    for node in range(2):
        cmd = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two-nodes",
            *torchrun_flags(rdzv, out / "logs" / "ranks"),
            "--max-restarts=0",
            "-m",
            "trainers.pretrain",
            str(spec),
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115  (closed with the process)
        nodes.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        if node == 0:  # node 0 first: its torchrun hosts the c10d store (whoever binds the port does)
            _wait_listening(nodes[0], port)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "the job did not train"
            time.sleep(0.2)
        ranks = [c for n in nodes for c in psutil.Process(n.pid).children(recursive=True)]
        os.killpg(nodes[victim].pid, signal.SIGKILL)  # torchrun; its rank ends with it (protect_rank)
        killed = time.monotonic()
        survivor = nodes[1 - victim]
        survivor.wait(timeout=120)
        return survivor, tmp_path / f"node{1 - victim}.log", killed
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
            n.wait()
        for rank in ranks:  # what this test started, by pid
            if rank.is_running():
                rank.kill()


def _facts(log: Path, spec: Path):
    first, summary, lost = FirstError(), TorchrunSummary(), LostPeer(endpoint=None)
    lines = log.read_text().splitlines()
    for line in lines:
        first.feed(line)
        summary.feed(line)
        lost.feed(line)
    return lines, failure_facts(spec, spec.parent, summary, first, returncode=1, who="torchrun", lost=lost)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["peer-node-dies", "store-node-dies"])
def test_when_a_node_dies_the_survivor_ends_in_seconds_and_names_what_it_lost(tmp_path, victim):
    survivor, log, killed = _two_nodes(tmp_path, victim)
    ended_in = time.monotonic() - killed
    assert survivor.returncode != 0 and ended_in < 60, ended_in
    lines, facts = _facts(log, tmp_path / "stage" / "spec.json")
    assert any(line.startswith(f"[rank{1 - victim}]: ") for line in lines)  # rank-labelled output
    assert (tmp_path / "stage" / "logs" / "ranks").is_dir()  # and the per-rank logs
    if victim == 0:
        assert facts.lost.startswith("the rendezvous store at 127.0.0.1:")
    else:
        assert facts.lost.startswith("peer 127.0.0.1:")
    assert facts.external and "that node died or its network failed" in facts.cause()
