"""SAO (trainers/posttrain/sao.py, rollout.py, sao_objective.py): the objective on hand-computed
numbers, then the trainer with its rollout process as the launched `sao` step, with faults
injected from outside: the rollout worker and the trainer SIGKILLed by pid.

Fast: AReaL's decoupled PPO loss (truncated importance weights behaviour -> proximal, clipping
proximal -> current), its gradient, the ESS; GAE against the direct sum of discounted TD errors;
staleness dropping and counting; explained variance; the rollout queue's sequence numbers.

Slow (the tiny 2-layer SmolLM3 of test_posttrain_steps, one rollout worker): the step through the
launcher with its worker killed mid-run (restarted, no sample lost or trained twice), the
trainer killed after a checkpoint, and the trainer stopped by SIGTERM (it saves the step it was
at); each rerun resumes, and every sample number is trained or dropped exactly once in
metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from infra.launchers import LaunchConfig, LaunchFailed
from pipeline.artifact import MARKER, Artifact, read_marker, run_step
from trainers.posttrain import rollout
from trainers.posttrain.sao_objective import decoupled_ppo_loss, ess, explained_variance, gae, split_stale
from trainers.posttrain.sections import PosttrainConfig, PosttrainSpec, SAOConfig


def test_decoupled_ppo_weights_clipping_and_gradient_on_hand_computed_numbers():
    behav = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3]]))
    prox = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.3]]))  # raw weights 1, 2, 9 (-> cap 5)
    logp = torch.log(torch.tensor([[0.6, 0.4, 0.45, 0.9]])).requires_grad_()  # ratios 1.2, 1, 0.5
    adv = torch.tensor([[1.0, -1.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 4th token is padding
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, clip=0.1, is_cap=5.0)
    # token 0: min(1.2 x 1, 1.1 x 1) = 1.1, weight 1; token 1: ratio 1, weight 2, A -1;
    # token 2: min(0.5 x 2, 0.9 x 2) = 1.0, weight min(9, 5) = 5
    assert loss.item() == pytest.approx((-1.1 + 2.0 - 5.0) / 3, rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(8 / 3, rel=1e-6)
    assert stats["is_truncated_share"] == pytest.approx(1 / 3)
    assert stats["clip_share"] == pytest.approx(2 / 3)  # ratios 1.2 and 0.5 left [0.9, 1.1]
    assert stats["ess"] == pytest.approx(64 / 30, rel=1e-6) and stats["ess_share"] == pytest.approx(64 / 90, rel=1e-6)
    loss.backward()
    # d/dlogp of -w r A / 3: zero where the clip is active (token 0) and on padding
    want = [0.0, -2.0 * 1.0 * -1.0 / 3, -5.0 * 0.5 * 2.0 / 3, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_on_policy_the_objective_is_ppo_and_the_ess_is_the_token_count():
    logp = torch.log(torch.tensor([[0.3, 0.6]]))
    adv = torch.tensor([[0.5, -2.0]])
    loss, stats = decoupled_ppo_loss(logp, logp, logp, adv, torch.ones(1, 2), clip=0.2, is_cap=2.0)
    assert float(loss) == pytest.approx(-(0.5 - 2.0) / 2) and stats["ess"] == pytest.approx(2.0)
    assert stats["is_weight_mean"] == 1.0 and stats["clip_share"] == 0.0
    assert ess(torch.tensor([1.0, 0.0, 0.0])) == {"ess": 1.0, "ess_share": pytest.approx(1 / 3)}


def test_gae_on_hand_computed_numbers_and_against_the_direct_sum():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.5, 0.7])
    # deltas 0.3, 0.2, 0.3 (terminal value 0); A2 = 0.3, A1 = 0.2 + 0.5 x 0.3, A0 = 0.3 + 0.5 x 0.35
    assert gae(rewards, values, 1.0, 0.5).tolist() == pytest.approx([0.475, 0.35, 0.3])
    # lambda 1 (the value targets): return minus value
    assert gae(rewards, values, 1.0, 1.0).tolist() == pytest.approx([0.8, 0.5, 0.3])
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    gamma, lam = 0.9, 0.7
    nxt = torch.cat([v[1:], torch.zeros(1, dtype=torch.float64)])
    delta = r + gamma * nxt - v
    direct = [sum((gamma * lam) ** k * float(delta[t + k]) for k in range(7 - t)) for t in range(7)]
    assert gae(r, v, gamma, lam).tolist() == pytest.approx(direct, rel=1e-12)
    with pytest.raises(ValueError, match=r"rewards \(3,\) and values \(2,\)"):
        gae(rewards, values[:2], 1.0, 1.0)


def test_samples_beyond_the_staleness_bound_are_dropped_and_counted_by_lag():
    samples = [{"seq": i, "version": v} for i, v in enumerate([5, 4, 3, 2, 5, 3])]
    kept, dropped = split_stale(samples, version=5, max_staleness=1)
    assert [s["seq"] for s in kept] == [0, 1, 4]
    assert dropped == Counter({2: 2, 3: 1})
    kept, dropped = split_stale(samples, version=5, max_staleness=0)
    assert [s["seq"] for s in kept] == [0, 4] and sum(dropped.values()) == 4
    with pytest.raises(ValueError, match="policy version 6 reached the trainer at version 5"):
        split_stale([{"version": 6}], version=5, max_staleness=1)


def test_explained_variance():
    t = torch.tensor([1.0, 2.0, 4.0])
    assert explained_variance(t, t) == 1.0
    assert explained_variance(torch.full((3,), float(t.mean())), t) == pytest.approx(0.0)
    assert explained_variance(t, torch.ones(3)) == 0.0  # constant targets: nothing to explain


def test_a_restarted_worker_starts_at_its_first_missing_sample_at_or_after_the_queue_position(tmp_path):
    rollout.queue_dir(tmp_path, "s1").mkdir(parents=True)
    rollout.write_consumed(tmp_path, 5)
    for seq in (5, 6, 7, 9):
        rollout.sample_path(tmp_path, "s1", seq).write_text("{}")
    assert rollout.first_free_seq(tmp_path, "s1", 0, 1) == 8
    # two workers: worker 1 owns the odd numbers (7 and 9 are there), worker 0 the even ones
    assert rollout.first_free_seq(tmp_path, "s1", 1, 2) == 11 and rollout.first_free_seq(tmp_path, "s1", 0, 2) == 8
    assert sorted(rollout.prompt_order(10, 0)) == list(range(10)) and rollout.prompt_order(10, 0) != list(range(10))


# --- the step, launched, with faults from outside --------------------------------------------

SAO = SAOConfig(
    enabled=True,
    max_steps=4,
    value_warmup=1,
    batch=4,
    max_completion_length=12,
    save_steps=2,
    queue_size=8,
    max_staleness=1,  # the worker runs up to 8 samples (2 versions) ahead: some are dropped
)


# One pytest-xdist worker runs this module, so its module fixture (the base model and the chat data)
# is built once, not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("sao-world")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny base model and the chat data's prompts, as input artifacts."""
    from tasks.posttrain.data import posttrain_data
    from tests.tasks.test_posttrain_steps import DATA, corpus_texts, make_corpora, make_tiny_model
    from tests.trainers.test_posttrain import hf_input
    from trainers.posttrain.sections import ChatDataSpec

    root = tmp_path_factory.mktemp("sao")
    corpora = make_corpora(root / "corpora")
    base = make_tiny_model(root, corpus_texts(corpora))
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=root / "data", log=lambda _: None)
    (root / "data" / MARKER).write_text("{}")
    data = Artifact(kind="corpus", uri=str(root / "data"), fingerprint="d" * 64, meta={})
    return {"model": hf_input(root / "in-base", base, "base"), "data": data}


def build(world, root: Path, log=lambda _: None, section: SAOConfig = SAO) -> Artifact:
    """The sao step as the flow runner runs it (its build here, the trainer launched, one rank)."""
    from tasks.posttrain.sao import sao

    run = PosttrainSpec.of(
        section, PosttrainConfig(device="cpu"), launch=LaunchConfig(module="trainers.posttrain"), threads=1
    )
    inputs = {"model": world["model"], "data": world["data"]}
    return run_step(
        root=root,
        step=sao.name,
        version=sao.version,
        kind=sao.kind,
        config=run,
        inputs=inputs,
        extra=sao.facts(run),
        resumable=sao.resumable,
        build=lambda out: sao.run(run, inputs, out, log=log),
    ).artifact


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_every_sample_once(artifact: Artifact) -> list[dict]:
    """Each sample number taken from the queue is trained or dropped exactly once, none skipped."""
    got = rows(artifact.path)
    assert [r["step"] for r in got] == list(range(1, SAO.value_warmup + SAO.max_steps + 1))
    seqs = [s for r in got for s in r["seqs"] + r["dropped_seqs"]]
    assert sorted(seqs) == list(range(artifact.meta["samples"])), seqs
    dropped = sum(len(r["dropped_seqs"]) for r in got)
    assert dropped == sum(artifact.meta["dropped_stale"].values()) == got[-1]["dropped_stale"]
    assert all(len(r["seqs"]) == SAO.batch for r in got)
    return got


class Watcher(threading.Thread):
    """Calls `act(folder)` once on the step's folder as soon as `ready(folder)` holds."""

    def __init__(self, root: Path, ready, act):
        super().__init__(daemon=True)
        self.root, self.ready, self.act, self.done = root, ready, act, None

    def run(self) -> None:
        for _ in range(30000):
            for folder in (self.root / "sao").glob("*"):
                if folder.is_dir() and self.ready(folder):
                    self.done = self.act(folder)
                    return
            threading.Event().wait(0.02)


def _kill_worker(folder: Path) -> int:
    pid = int(json.loads((folder / "rollout" / "workers.json").read_text())["0"])
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_sao_step_end_to_end_survives_a_killed_rollout_worker(world, tmp_path):
    watcher = Watcher(
        tmp_path,
        lambda f: (f / "metrics.jsonl").is_file() and bool((f / "metrics.jsonl").read_text().strip()),
        _kill_worker,
    )
    watcher.start()
    lines: list[str] = []
    artifact = build(world, tmp_path, lines.append)
    watcher.join(timeout=5)
    assert watcher.done is not None, "the run ended before its worker could be killed"
    died = [i for i, line in enumerate(lines) if f"rollout worker 0 (pid {watcher.done}) ended by signal 9" in line]
    assert len(died) == 1, lines
    # with the tail of its own output, the log of that life (its lines reach the step's log one by one)
    assert f"restarting it. Its last output ({tmp_path}/sao/" in lines[died[0]], lines[died[0]]
    assert lines[died[0]].endswith("/rollout/worker-0.log):") and lines[died[0] + 1].startswith("  | "), lines
    meta = artifact.meta
    assert meta["rollout_restarts"] >= 1 and meta["steps"] == 5 and meta["policy_version"] == SAO.max_steps
    got = assert_every_sample_once(artifact)
    assert got[0]["phase"] == "value" and {r["phase"] for r in got[1:]} == {"policy"}
    for r in got[1:]:  # the policy rows carry the off-policy statistics
        assert 0 < r["ess_share"] <= 1 + 1e-6 and {"loss", "is_weight_mean", "clip_share", "kl_start"} <= set(r)
    assert all({"value_loss", "explained_variance", "reward", "staleness_mean"} <= set(r) for r in got)
    # staleness of what was trained never exceeds the bound
    assert all(int(k.split("/")[1]) <= SAO.max_staleness for r in got for k in r if k.startswith("staleness/"))
    assert Path(meta["model_dir"], "model.safetensors").is_file() and meta["stage"] == "sao"
    assert 0 <= meta["trainer_idle_share"] <= 1 and meta["samples_per_s"] > 0
    # the reward's trend reads every update, across the worker's restart: 5, under the 6 a trend needs
    assert meta["reward_trend"] is None and meta["reward_by_part"] is None
    assert any(line.endswith("; reward 5 update(s): too few for a trend") for line in lines), lines[-5:]


def _trainer(folder: Path) -> psutil.Process | None:
    try:
        procs = psutil.Process(int((folder / ".trainer.pgid").read_text())).children(recursive=True)
    except (OSError, ValueError, psutil.Error):
        return None
    for p in procs:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "trainers.posttrain" in cmd and not any("torch" in c or "lifeline" in c for c in cmd):
            return p
    return None


def _kill_trainer(folder: Path) -> tuple[int, int]:
    from trainers.posttrain.common import complete_checkpoints

    after = complete_checkpoints(folder / "checkpoints")[-1][0]
    worker = int(json.loads((folder / "rollout" / "workers.json").read_text())["0"])
    _trainer(folder).kill()
    return after, worker


@pytest.mark.slow
def test_sao_trainer_killed_after_a_checkpoint_resumes_without_losing_or_repeating_samples(world, tmp_path):
    from trainers.posttrain.common import complete_checkpoints

    watcher = Watcher(
        tmp_path,
        lambda f: bool(complete_checkpoints(f / "checkpoints")) and _trainer(f) is not None,
        _kill_trainer,
    )
    watcher.start()
    with pytest.raises(LaunchFailed) as err:
        build(world, tmp_path)
    watcher.join(timeout=5)
    after, worker = watcher.done
    assert "killed by SIGKILL" in err.value.cause
    # the rollout worker ended with its trainer (parent-death signal): gone already, or within
    # 20 s (on a loaded machine it may still be exiting, or awaiting its reaper, when asked)
    try:
        psutil.Process(worker).wait(timeout=20)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        pytest.fail(f"rollout worker {worker} outlived its killed trainer by 20 s")
    folder = next(p for p in (tmp_path / "sao").iterdir() if p.is_dir())
    assert read_marker(folder) is None
    lines: list[str] = []
    artifact = build(world, tmp_path, lines.append)
    assert any(f"resuming from step_{after:08d}" in line for line in lines), lines
    assert artifact.meta["resumed_from_step"] == after and artifact.meta["steps"] == 5
    assert_every_sample_once(artifact)
    final = complete_checkpoints(artifact.path / "checkpoints")
    assert final[-1][0] == 5 and final[-1][2]["stage_end"]
    state = json.loads((final[-1][1] / "state.json").read_text())
    assert state["version"] == SAO.max_steps and state["consumed"] == artifact.meta["samples"]


def _stop_trainer(folder: Path) -> int:
    sent_after = len(rows(folder))
    _trainer(folder).send_signal(signal.SIGTERM)
    return sent_after


@pytest.mark.slow
def test_sao_stopped_by_a_signal_saves_that_step_and_the_resume_loses_no_sample(world, tmp_path):
    from trainers.posttrain.common import complete_checkpoints

    section = SAO.model_copy(update={"save_steps": 100})  # only the end: a stop must save by itself
    watcher = Watcher(
        tmp_path,
        lambda f: (f / "metrics.jsonl").is_file() and len(rows(f)) >= 1 and _trainer(f) is not None,
        _stop_trainer,
    )
    watcher.start()
    with pytest.raises(LaunchFailed) as err:
        build(world, tmp_path, section=section)
    watcher.join(timeout=5)
    assert watcher.done is not None, "the trainer finished before the signal"
    assert err.value.facts.exitcode == 75 and "stopped on a signal" in err.value.cause
    folder = next(p for p in (tmp_path / "sao").iterdir() if p.is_dir())
    (saved, _, _), *_ = complete_checkpoints(folder / "checkpoints")
    assert watcher.done <= saved <= watcher.done + 1  # the step being trained
    lines: list[str] = []
    artifact = build(world, tmp_path, lines.append, section=section)
    assert any(f"resuming from step_{saved:08d}" in line for line in lines), lines
    assert artifact.meta["resumed_from_step"] == saved
    assert_every_sample_once(artifact)


def test_the_flow_runs_sao_beside_grpo_from_the_same_model_on_one_rank(tmp_path):
    """With the 3B recipe's 8-node FSDP launch, sao gets one node and one process (its trainer is
    one rank that starts its own rollout workers); it reads what grpo reads and is scored."""
    from flows.graphs import flow_graph, plan
    from flows.recipe import load_recipe

    cfg = load_recipe("smollm3-3b", [f"workspace={tmp_path / 'ws'}", "posttrain.sao.enabled=true"])
    g = flow_graph("smollm3", cfg)
    sao, grpo = g.node("sao[sao]"), g.node("grpo[grpo]")
    assert sao.inputs["model"].key == grpo.inputs["model"].key == "merge[merge]"
    assert sao.inputs["data"].key == grpo.inputs["data"].key
    assert g.node("evaluate[sao]").inputs["model"].key == "sao[sao]"
    rows = {r.key: r for r in plan(cfg)}
    where = rows["sao[sao]"].launch
    assert where.startswith("slurm, 1 node x 1 process (1 GPU") and "torchrun" in where, where
    assert "8 nodes" in rows["grpo[grpo]"].launch
    assert "sao[sao]" not in {n.key for n in flow_graph("smollm3", load_recipe("smollm3-3b", []))}  # off by default


# --- the rollout pool: workers in processes of their own, not the trainer's -------------------

POOLED = SAO.model_copy(update={"rollout_nodes": 1, "rollout_timeout_s": 300.0})


def _policy(world) -> Path:
    from trainers.posttrain.common import model_dir

    return model_dir(world["model"])


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_sao_trains_on_the_samples_of_a_rollout_pool_started_from_outside(world, tmp_path):
    """The pool node is started by the test with the command line the launcher renders (as the
    pool's job would run it); the trainer starts no worker, trains on the pool's samples, and its
    end ends the pool."""
    from infra.launchers import get_launcher
    from trainers.posttrain.launch import rollout_pool
    from trainers.posttrain.sao import train_sao

    out = tmp_path / "sao"
    rendered = get_launcher(LaunchConfig(module="trainers.posttrain")).render_pool(rollout_pool(POOLED, out), out)
    (command,) = rendered.splitlines()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(tmp_path / "pool.log", "wb") as log:
        node = subprocess.Popen(shlex.split(command), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        lines: list[str] = []
        meta = train_sao(POOLED, _policy(world), world["data"].path, out, device="cpu", log=lines.append)
        assert node.wait(timeout=60) == 0  # the trainer's `done` ended the pool
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert any("no local worker" in line for line in lines), lines
    assert not (out / "rollout" / rollout.WORKERS_FILE).exists()  # the trainer started none...
    assert list(json.loads((out / "rollout" / "workers-node0.json").read_text())) == ["0"]  # ...the pool node did
    assert meta["steps"] == SAO.value_warmup + SAO.max_steps and meta["rollout_restarts"] == 0
    got = rows(out)
    seqs = [s for r in got for s in r["seqs"] + r["dropped_seqs"]]
    assert sorted(seqs) == list(range(meta["samples"]))
    text = (tmp_path / "pool.log").read_text()
    assert "rollout pool node 0/1" in text and "the trainer is done" in text, text


@pytest.mark.slow
def test_a_rollout_pool_that_never_produces_stops_the_trainer_naming_its_job(world, tmp_path):
    """The pool's one node is frozen (SIGSTOP) from outside as soon as it starts: no sample comes."""
    from infra.launchers import get_launcher
    from infra.launchers.pool import PoolRunner, read_pool_record
    from trainers.posttrain.launch import rollout_pool
    from trainers.posttrain.sao import RolloutPoolSilent, train_sao

    out = tmp_path / "sao"
    section = POOLED.model_copy(update={"rollout_timeout_s": 3.0})
    launcher = get_launcher(LaunchConfig(module="trainers.posttrain"))
    with PoolRunner(launcher, rollout_pool(section, out), out, lambda _: None, poll_s=0.2):
        pid = int(read_pool_record(out, "rollout")["job"])
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(RolloutPoolSilent) as err:
                train_sao(section, _policy(world), world["data"].path, out, device="cpu", log=lambda _: None)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert f"no sample from the local rollout pool (1 process, pid {pid}) for 3 s (waiting for sample 0" in str(
        err.value
    )


@pytest.mark.slow
def test_the_vllm_engine_asked_for_where_it_does_not_import_stops_the_trainer_with_why(world, tmp_path):
    from trainers.posttrain.sao import train_sao

    section = SAO.model_copy(update={"engine": "vllm"})
    with pytest.raises(
        RuntimeError, match=r"rollout worker 0 on .*: RuntimeError: posttrain.sao.engine is vllm but vllm"
    ):
        train_sao(section, _policy(world), world["data"].path, tmp_path / "sao", device="cpu", log=lambda _: None)


def test_the_vllm_engine_refused_with_the_field_the_extra_and_the_import_s_own_error(tmp_path, monkeypatch):
    """vLLM requested where it does not import: absent here (no GPU), and a broken install (a
    `vllm` package whose import fails with OSError, as one without its CUDA libraries does)."""
    assert rollout.resolve_engine("transformers") == "transformers"
    assert rollout.resolve_engine("auto") == "transformers"  # no GPU, no vLLM: the CPU engine
    with pytest.raises(ValueError, match=r"posttrain.sao.engine: 'vlm' is not one of transformers, vllm, auto"):
        rollout.resolve_engine("vlm")
    with pytest.raises(RuntimeError) as absent:
        rollout.resolve_engine("vllm")
    assert "posttrain.sao.engine is vllm but vllm does not import on this node (ModuleNotFoundError: No module " in (
        str(absent.value)
    )
    assert "pip install 'smollm3-pipeline[vllm]'" in str(absent.value)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('raise OSError("libcuda.so.1: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with pytest.raises(RuntimeError, match=r"does not import on this node \(OSError: libcuda.so.1: cannot open"):
        rollout.resolve_engine("vllm")
    assert rollout.resolve_engine("auto") == "transformers"  # never imported without a GPU


def _segfault_each_start(folder: Path, killed: list[int], stop: threading.Event, record=rollout.WORKERS_FILE) -> None:
    """SIGSEGV every start of rollout worker 0 once it has said it started (its fault handler is
    armed then): the worker's log names the pid of the life it holds."""
    while not stop.is_set():
        try:
            pid = int(json.loads((folder / record).read_text())["0"])
            started = f"(pid {pid})" in rollout.worker_log(folder, 0).read_text()
        except (OSError, ValueError, KeyError):
            pid, started = None, False
        if started and pid not in killed:
            os.kill(pid, signal.SIGSEGV)
            killed.append(pid)
        stop.wait(0.01)


@pytest.mark.slow
def test_a_rollout_worker_that_keeps_dying_stops_the_trainer_with_its_output(world, tmp_path):
    """Each start of the rollout worker is sent SIGSEGV from outside: every death is logged with
    the tail of the worker's own output (here the fault handler's stack), the worker is restarted
    until it has died MAX_BARREN_DEATHS times in a row without a sample, and then the trainer
    stops with that tail in its error instead of restarting it for ever."""
    from trainers.posttrain.sao import train_sao

    out, killed, stop, lines = tmp_path / "sao", [], threading.Event(), []
    killer = threading.Thread(target=_segfault_each_start, args=(out / "rollout", killed, stop), daemon=True)
    killer.start()
    try:
        with pytest.raises(rollout.RolloutWorkerFailed) as err:
            train_sao(SAO, _policy(world), world["data"].path, out, device="cpu", log=lines.append)
    finally:
        stop.set()
        killer.join(timeout=5)
    assert len(killed) == rollout.MAX_BARREN_DEATHS == 3, killed
    message = str(err.value)
    assert message.startswith(
        f"sao: rollout worker 0 (pid {killed[-1]}) ended by signal 11, 3 times in a row without producing a sample"
    ), message
    # the tail of the last life's log: the fault handler's stack (its oldest frames: the worker's module)
    log = rollout.worker_log(out / "rollout", 0)
    text = log.read_text()
    assert "Fatal Python error: Segmentation fault" in text and "trainers/posttrain/rollout.py" in text, text
    tail = "\n".join(f"  | {line}" for line in text.splitlines()[-rollout.LOG_TAIL :])
    assert message.endswith(f"Its last output ({log}):\n{tail}"), message
    assert "trainers/posttrain/rollout.py" in tail
    restarts = [line for line in lines if "restarting it" in line]
    assert len(restarts) == 2, lines
    for line, pid in zip(restarts, killed, strict=False):
        assert f"rollout worker 0 (pid {pid}) ended by signal 11; restarting it. Its last output ({log}):" in line
        assert "trainers/posttrain/rollout.py" in line
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in killed)


@pytest.mark.slow
def test_a_pool_worker_that_keeps_dying_stops_the_trainer_with_its_output(world, tmp_path):
    """The same fault on a pool node's worker (the node started by the test as its job would run
    it): the node gives up on it, reports its output through the rollout folder and exits 3, and
    the trainer stops with that report instead of waiting for the pool's timeout."""
    from infra.launchers import get_launcher
    from trainers.posttrain.launch import rollout_pool
    from trainers.posttrain.sao import train_sao

    out, killed, stop = tmp_path / "sao", [], threading.Event()
    rendered = get_launcher(LaunchConfig(module="trainers.posttrain")).render_pool(rollout_pool(POOLED, out), out)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(tmp_path / "pool.log", "wb") as log:
        node = subprocess.Popen(shlex.split(rendered), env=env, stdout=log, stderr=subprocess.STDOUT)
    killer = threading.Thread(
        target=_segfault_each_start, args=(out / "rollout", killed, stop, "workers-node0.json"), daemon=True
    )
    killer.start()
    try:
        with pytest.raises(RuntimeError) as err:
            train_sao(POOLED, _policy(world), world["data"].path, out, device="cpu", log=lambda _: None)
        assert node.wait(timeout=60) == 3
    finally:
        stop.set()
        killer.join(timeout=5)
        if node.poll() is None:
            node.kill()
            node.wait()
    assert len(killed) == 3, killed
    message = str(err.value)
    assert message.startswith("sao: a rollout worker cannot start: rollout worker 0 on "), message
    assert f": sao: rollout worker 0 (pid {killed[-1]}) ended by signal 11, 3 times in a row" in message, message
    log = rollout.worker_log(out / "rollout", 0)
    assert message.endswith("\n".join(f"  | {line}" for line in log.read_text().splitlines()[-rollout.LOG_TAIL :]))
    assert "trainers/posttrain/rollout.py" in message
    assert (
        f"rollout worker 0 (pid {killed[0]}) ended by signal 11; restarting it" in (tmp_path / "pool.log").read_text()
    )


def _kill_pool(folder: Path) -> int:
    from infra.launchers.pool import read_pool_record

    pid = int(read_pool_record(folder, "rollout")["job"])
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_sao_step_with_a_rollout_pool_survives_the_pool_s_death(world, tmp_path):
    """The step on the local launcher with `rollout_nodes: 1`: its launch starts the pool beside
    the trainer; the pool's node is SIGKILLed mid-run, the launch resubmits it, and the trainer
    ends on every sample exactly once."""
    watcher = Watcher(
        tmp_path,
        lambda f: (f / "metrics.jsonl").is_file() and bool((f / "metrics.jsonl").read_text().strip()),
        _kill_pool,
    )
    watcher.start()
    lines: list[str] = []
    artifact = build(world, tmp_path, lines.append, section=POOLED)
    watcher.join(timeout=5)
    assert watcher.done is not None, "the run ended before its pool could be killed"
    text = "\n".join(lines)
    assert f"ended: node 0 (pid {watcher.done}) killed by signal 9 while the trainer runs; resubmitting" in text, text
    assert "no local worker" in text
    assert artifact.meta["steps"] == 5 and artifact.meta["policy_version"] == SAO.max_steps
    assert_every_sample_once(artifact)
    assert not (artifact.path / "launch" / "rollout-pool.json").exists()  # stopped with the launch


def test_the_rollout_pool_shows_in_the_plan_and_moves_no_fingerprint(tmp_path):
    from flows.graphs import plan
    from flows.recipe import load_recipe

    base = ["posttrain.sao.enabled=true", f"workspace={tmp_path / 'ws'}"]
    local = {r.key: r for r in plan(load_recipe("smollm3-3b", base))}["sao[sao]"]
    pooled = load_recipe("smollm3-3b", [*base, "posttrain.sao.rollout_nodes=4", "posttrain.sao.engine=auto"])
    row = {r.key: r for r in plan(pooled)}["sao[sao]"]
    assert "rollout pool: 4 node(s) x 1 worker(s), auto" in row.launch and "rollout pool" not in local.launch
    assert row.fingerprint == local.fingerprint  # how the rollouts run, not what the step computes
    with pytest.raises(ValueError, match="posttrain.sao.engine"):
        load_recipe("smollm3-3b", [*base, "posttrain.sao.engine=sglang"])
