"""Post-training steps as launched jobs (trainers/posttrain/launch.py), on CPU with gloo.

- 2 processes give the 1-process loss curve: SFT through `accelerate launch` with the CPU DDP
  accelerate config, APO through torchrun. Same batch per optimizer step, same sample order
  (accelerate hands rank r the r-th micro-batch of the single process's batch), same loss
  normalisation (SFT divides by the assistant tokens of the whole batch, DPO averages pairs);
  what differs is only where float32 sums are split (each rank sums its half, the all-reduce adds
  the halves). Measured: equal to 1e-7 relative; asserted within 1e-5 relative, which
  float32 rounding (eps 1.2e-7) over 6 steps stays far inside and any change of data, order or
  normalisation (the loss moves in the 3rd digit per step) falls far outside.
- SFT, APO and GRPO SIGKILLed from outside (the rank process, as the OOM killer would) after a
  checkpoint: the launch fails with a cause naming the signal and the checkpoint, and the rerun
  resumes from that checkpoint; SFT and APO then end on exactly the uninterrupted run's losses.
- S3: checkpoints are mirrored while the trainer runs; with the local copies wiped, the rerun
  pulls the newest one back and resumes from it.

Uses the tiny world of test_posttrain_steps (2-layer SmolLM3, BPE tokenizer, builtin chat data).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import psutil
import pytest

from infra.launchers import LaunchConfig, LaunchFailed
from infra.storage import StorageConfig
from pipeline.artifact import MARKER, Artifact, read_marker, run_step
from tasks.posttrain.data import posttrain_data
from tests.infra.test_storage import s3  # noqa: F401  (fixture: a moto S3 server)
from tests.tasks.test_posttrain_steps import DATA, corpus_texts, make_corpora, make_tiny_model
from trainers.posttrain.common import complete_checkpoints, reward_trend
from trainers.posttrain.sections import (
    ChatDataSpec,
    GRPOConfig,
    PosttrainConfig,
    PosttrainSpec,
    PreferenceConfig,
    SFTConfig,
)

REPO = Path(__file__).resolve().parents[2]
SFT = SFTConfig(max_steps=6, batch=8, max_length=256, save_steps=2)
APO = PreferenceConfig(max_steps=6, batch=4, samples_per_prompt=2, max_new_tokens=12, save_steps=2)
GRPO = GRPOConfig(max_steps=6, batch=4, num_generations=2, max_completion_length=12, save_steps=2, lr=1e-3)
PT = PosttrainConfig(device="cpu")


def run_of(section, procs: int = 1, accelerate: str | None = None, storage: StorageConfig | None = None):
    launch = LaunchConfig(module="trainers.posttrain", procs_per_node=procs, accelerate_config=accelerate)
    return PosttrainSpec.of(section, PT, launch=launch, storage=storage, threads=1)


def hf_input(folder: Path, model_dir: Path, name: str) -> Artifact:
    """An `hf_model` input artifact (a finished folder whose meta points at the HF folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("{}")
    return Artifact(
        kind="hf_model",
        uri=str(folder),
        fingerprint=(name * 64)[:64],
        meta={"model_dir": str(model_dir), "stage": name},
    )


# One pytest-xdist worker runs this module, so its module fixture (the base model and the 1-process SFT and APO runs) is built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("posttrain-world")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Base model and chat data as input artifacts, and the uninterrupted 1-process SFT and APO
    runs that the other tests compare against."""
    root = tmp_path_factory.mktemp("launched")
    corpora = make_corpora(root / "corpora")
    base = make_tiny_model(root, corpus_texts(corpora))
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=root / "data", log=lambda _: None)
    (root / "data" / MARKER).write_text("{}")
    data = Artifact(kind="corpus", uri=str(root / "data"), fingerprint="d" * 64, meta={})
    w = {"root": root, "data": data, "base": hf_input(root / "in-base", base, "base")}
    w["sft1"] = build("sft", run_of(SFT), {"model": w["base"], "data": data}, root / "ref")
    w["sft"] = hf_input(root / "in-sft", Path(w["sft1"].meta["model_dir"]), "sft")
    w["apo1"] = build("preference", run_of(APO), {"model": w["sft"], "data": data}, root / "ref")
    return w


def step_def(name: str):
    from tasks.posttrain import grpo, preference, sft

    return {"sft": sft.sft, "preference": preference.preference, "grpo": grpo.grpo}[name]


def build(name: str, run: PosttrainSpec, inputs: dict, root: Path, log=lambda _: None):
    """Run the step as the flow runner does (its build in this process, resumable folder)."""
    d = step_def(name)
    return run_step(
        root=root,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config=run,
        inputs=inputs,
        extra=d.facts(run),
        resumable=d.resumable,
        build=lambda out: d.run(run, inputs, out, log=log),
    ).artifact


def losses(artifact: Artifact) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (artifact.path / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def assert_same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=rel), f"step {step}: {a} vs {b}"


# --- several processes --------------------------------------------------------------------


@pytest.mark.slow
def test_sft_on_two_processes_through_accelerate_matches_one_process(world, tmp_path):
    lines: list[str] = []
    two = build(
        "sft",
        run_of(SFT, procs=2, accelerate="configs/accelerate/cpu-ddp.yaml"),
        {"model": world["base"], "data": world["data"]},
        tmp_path,
        lines.append,
    )
    assert two.meta["world_size"] == 2 and world["sft1"].meta["world_size"] == 1
    assert "accelerate (configs/accelerate/cpu-ddp.yaml)" in two.meta["launch"]
    launch = next(line for line in lines if line.startswith("[launch] "))
    assert "accelerate" in launch and "--num_processes 2" in launch and "-m trainers.posttrain" in launch
    assert_same_curve(losses(two), losses(world["sft1"]), rel=1e-5)
    assert len(losses(two)) == SFT.max_steps


@pytest.mark.slow
def test_apo_on_two_processes_matches_one_process(world, tmp_path):
    two = build("preference", run_of(APO, procs=2), {"model": world["sft"], "data": world["data"]}, tmp_path)
    assert two.meta["world_size"] == 2 and "torchrun" in two.meta["launch"]
    # the pairs are made once, by the main rank, from the same seed: the same pairs
    assert (two.path / "pairs.jsonl").read_text() == (world["apo1"].path / "pairs.jsonl").read_text()
    assert_same_curve(losses(two), losses(world["apo1"]), rel=1e-5)


# --- killed from outside, resumed ---------------------------------------------------------


def _rank_processes(pgid: int) -> list[psutil.Process]:
    """The trainer ranks under a launch's guard (not the guard, torchrun or accelerate)."""
    try:
        procs = psutil.Process(pgid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "trainers.posttrain" in cmd and not any(
            w in cmd for w in ("torch.distributed.run", "torchrun", "accelerate", "lifeline")
        ):
            ranks.append(p)
    return ranks


class Killer(threading.Thread):
    """SIGKILLs the trainer's ranks (as the OOM killer would) once a checkpoint is published
    (`mirrored`: and its main rank recorded it as uploaded to S3, `mirror.jsonl`)."""

    def __init__(self, root: Path, step: str, mirrored: bool = False):
        super().__init__(daemon=True)
        self.root, self.step, self.mirrored = root, step, mirrored
        self.killed_after: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            for folder in (self.root / self.step).glob("*"):
                done = complete_checkpoints(folder / "checkpoints")
                if self.mirrored:
                    done = [d for d in done if d[1].name in _uploaded(folder)]
                pgid = folder / ".trainer.pgid"
                if done and pgid.exists():
                    ranks = _rank_processes(int(pgid.read_text()))
                    if ranks:
                        self.killed_after = done[-1][0]
                        for p in ranks:
                            p.kill()
                        return


def _uploaded(folder: Path) -> set[str]:
    try:
        rows = [json.loads(line) for line in (folder / "mirror.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return set()
    return {r["checkpoint"] for r in rows if r.get("event") == "uploaded"}


def kill_then_resume(name: str, run: PosttrainSpec, inputs: dict, root: Path) -> tuple[Artifact, int, str]:
    killer = Killer(root, name)
    killer.start()
    with pytest.raises(LaunchFailed) as err:
        build(name, run, inputs, root)
    killer.join(timeout=5)
    assert killer.killed_after is not None, "the trainer finished before it could be killed"
    folder = next(p for p in (root / name).iterdir() if p.is_dir())
    assert read_marker(folder) is None and not (folder / "result.json").exists()
    lines: list[str] = []
    artifact = build(name, run, inputs, root, lines.append)
    assert any(f"resuming from step_{killer.killed_after:08d}" in line for line in lines)
    return artifact, killer.killed_after, err.value.cause


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "preference"])
def test_sft_and_apo_killed_mid_run_resume_and_end_on_the_uninterrupted_losses(world, tmp_path, name):
    section, inputs, reference = {
        "sft": (SFT, {"model": world["base"], "data": world["data"]}, world["sft1"]),
        "preference": (APO, {"model": world["sft"], "data": world["data"]}, world["apo1"]),
    }[name]
    artifact, after, cause = kill_then_resume(name, run_of(section), inputs, tmp_path)
    assert "rank 0 killed by SIGKILL" in cause and f"last checkpoint: step {after}" in cause
    assert f"a retry resumes from step {after}" in cause
    assert artifact.meta["resumed_from_step"] == after and artifact.meta["steps"] == section.max_steps
    # weights, optimizer, schedule, RNG and data position came back: the same losses as a run
    # that was never killed (each step once in metrics.jsonl)
    assert_same_curve(losses(artifact), losses(reference), rel=1e-5)
    final = complete_checkpoints(artifact.path / "checkpoints")
    assert final[-1][0] == section.max_steps and final[-1][2]["stage_end"]
    assert len(final) <= section.keep_checkpoints + 1


@pytest.mark.slow
def test_grpo_killed_mid_run_resumes_from_its_last_checkpoint(world, tmp_path):
    artifact, after, cause = kill_then_resume(
        "grpo", run_of(GRPO), {"model": world["sft"], "data": world["data"]}, tmp_path
    )
    assert "killed by SIGKILL" in cause and f"last checkpoint: step {after}" in cause
    assert artifact.meta["resumed_from_step"] == after and artifact.meta["steps"] == GRPO.max_steps
    assert [s for s, _ in losses(artifact)] == list(range(1, GRPO.max_steps + 1))
    assert Path(artifact.meta["model_dir"], "model.safetensors").is_file()


# --- S3 mirror --------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoints_are_mirrored_and_a_wiped_folder_resumes_from_s3(world, tmp_path, s3, monkeypatch):  # noqa: F811
    """The trainer's main rank uploads (never this, the flow's, process); a rerun on a wiped
    folder pulls the newest one and ends on the uninterrupted losses."""
    from infra.storage import S3Store

    def no_upload_here(self, *args, **kwargs):
        raise AssertionError("the flow process uploaded a checkpoint")

    monkeypatch.setattr(S3Store, "upload_folder", no_upload_here)
    endpoint, client = s3
    storage = StorageConfig(s3_uri="s3://ckpts/run", endpoint_url=endpoint, keep_local=1, sync_every_s=0.2)
    run = run_of(SFT, storage=storage)
    inputs = {"model": world["base"], "data": world["data"]}
    killer = Killer(tmp_path, "sft", mirrored=True)
    killer.start()
    with pytest.raises(LaunchFailed):
        build("sft", run, inputs, tmp_path)
    killer.join(timeout=5)
    folder = next(p for p in (tmp_path / "sft").iterdir() if p.is_dir())
    prefix = f"run/sft/{folder.name}/checkpoints/"
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", [])}
    assert f"{prefix}step_{killer.killed_after:08d}/_CHECKPOINT.json" in keys  # mirrored, marker last
    shutil.rmtree(folder / "checkpoints")  # a new machine: nothing local
    lines: list[str] = []
    artifact = build("sft", run, inputs, tmp_path, lines.append)
    assert any(f"pulled step_{killer.killed_after:08d}" in line for line in lines)
    assert artifact.meta["resumed_from_step"] == killer.killed_after
    assert artifact.meta["s3_checkpoints"] == f"s3://ckpts/{prefix.rstrip('/')}"
    final = f"{prefix}step_{SFT.max_steps:08d}/_CHECKPOINT.json"
    assert final in {o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix=prefix)["Contents"]}
    rows = [json.loads(line) for line in (folder / "mirror.jsonl").read_text().splitlines()]
    assert rows and os.getpid() not in {r["pid"] for r in rows}  # uploaded by the trainer's process
    assert_same_curve(losses(artifact), losses(world["sft1"]), rel=1e-5)


def test_a_trainer_spec_carries_its_trainers_own_section_typed(tmp_path):
    """spec.json holds the section as the trainer's own class (no dict re-read on the ranks): it
    comes back typed, a field it lacks or a section of another trainer is refused, named."""
    from pydantic import ValidationError

    from trainers.posttrain.launch import TrainerSpec

    spec = TrainerSpec(trainer="sft", section=SFT, policy="p", data="d", out="o")
    spec.save(tmp_path / "spec.json")
    loaded = TrainerSpec.load(tmp_path / "spec.json")
    assert loaded == spec and type(loaded.section) is SFTConfig and loaded.section.max_length == 256
    assert (
        type(TrainerSpec(trainer="preference", section={}, policy="p", data="d", out="o").section) is PreferenceConfig
    )
    with pytest.raises(ValidationError, match="section.max_step: Extra inputs"):
        TrainerSpec(trainer="sft", section={"max_step": 1}, policy="p", data="d", out="o")
    with pytest.raises(ValidationError, match="trainer 'preference' takes a PreferenceConfig, got a SFTConfig"):
        TrainerSpec(trainer="preference", section=SFT, policy="p", data="d", out="o")


def test_a_batch_the_ranks_cannot_share_fails_before_anything_runs():
    with pytest.raises(ValueError, match=r"posttrain.sft.batch 8 is not divisible by the 3 ranks"):
        run_of(SFT, procs=3)
    assert (
        run_of(SFT.model_copy(update={"per_device_batch": 2}), procs=2)
        .launch_summary()
        .endswith("batch 8 = 2 ranks x 2 x 2 accumulation")
    )
    from infra.launchers import get_launcher

    with pytest.raises(FileNotFoundError, match="launch.accelerate_config nope.yaml does not exist"):
        spec = Path(__file__)  # any existing file: the config file is checked first
        get_launcher(run_of(SFT, accelerate="nope.yaml").launch).launch(spec, REPO, print)


# --- a stop signal is a checkpoint ------------------------------------------------------------


class Signaller(threading.Thread):
    """Sends SIGUSR1 to the trainer's rank (as Slurm's time-limit warning would reach it) once it
    has logged two steps; no checkpoint exists then (save_steps is past the end)."""

    def __init__(self, root: Path, step: str):
        super().__init__(daemon=True)
        self.root, self.step = root, step
        self.sent_at: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        import signal

        while not self.stop.wait(0.02):
            for folder in (self.root / self.step).glob("*"):
                pgid, metrics = folder / ".trainer.pgid", folder / "metrics.jsonl"
                rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
                steps = [r["step"] for r in rows if "loss" in r]
                if len(steps) >= 2 and pgid.exists():
                    ranks = _rank_processes(int(pgid.read_text()))
                    if ranks:
                        self.sent_at = steps[-1]
                        for p in ranks:
                            p.send_signal(signal.SIGUSR1)
                        return


@pytest.mark.slow
def test_sft_stopped_by_a_signal_saves_that_step_and_the_resume_loses_none(world, tmp_path):
    section = SFT.model_copy(update={"save_steps": 100})  # only the end: a stop must save by itself
    inputs = {"model": world["base"], "data": world["data"]}
    signaller = Signaller(tmp_path, "sft")
    signaller.start()
    with pytest.raises(LaunchFailed) as err:
        build("sft", run_of(section), inputs, tmp_path)
    signaller.join(timeout=5)
    assert signaller.sent_at is not None, "the trainer finished before the signal"
    assert err.value.facts.exitcode == 75 and "stopped on a signal" in err.value.cause
    folder = next(p for p in (tmp_path / "sft").iterdir() if p.is_dir())
    (saved, _, _), *_ = complete_checkpoints(folder / "checkpoints")
    assert signaller.sent_at <= saved <= signaller.sent_at + 1  # the step being trained
    lines: list[str] = []
    artifact = build("sft", run_of(section), inputs, tmp_path, lines.append)
    assert any(f"resuming from step_{saved:08d}" in line for line in lines)
    assert artifact.meta["resumed_from_step"] == saved
    assert_same_curve(losses(artifact), losses(world["sft1"]), rel=1e-5)  # each step once, as uninterrupted


@pytest.mark.slow
def test_on_a_cluster_launch_the_main_rank_pulls_the_checkpoint_and_the_step_moves_no_bytes(
    world,
    tmp_path,
    s3,  # noqa: F811
    monkeypatch,
):
    """A Slurm-kind APO run on 2 ranks (started here by the local launcher, as on a node) whose
    checkpoints are lost after a kill, with a killed pull's leftover in their folder: the step
    pulls nothing (the flow host moves no checkpoint bytes); the main rank pulls the newest
    checkpoint in its own process while the other waits for it, and both resume from it, ending
    on the uninterrupted losses."""
    import trainers.posttrain.launch as launch
    from infra.launchers import get_launcher
    from infra.storage import S3Store

    def not_here(*args, **kwargs):
        raise AssertionError("the flow process moved checkpoint bytes")

    monkeypatch.setattr(S3Store, "upload_folder", not_here)
    monkeypatch.setattr(S3Store, "download_folder", not_here)  # the ranks' processes are not patched
    monkeypatch.setattr(launch, "pull_latest_checkpoint", not_here)
    # no cluster here: the ranks start on this machine, as Slurm would start them on a node
    monkeypatch.setattr(
        launch, "get_launcher", lambda config: get_launcher(config.model_copy(update={"kind": "local"}))
    )
    endpoint, client = s3
    storage = StorageConfig(s3_uri="s3://ckpts/run", endpoint_url=endpoint, keep_local=1, sync_every_s=0.2)
    run = run_of(APO, procs=2, storage=storage)
    run = run.model_copy(update={"launch": run.launch.model_copy(update={"kind": "slurm"})})
    inputs = {"model": world["sft"], "data": world["data"]}
    killer = Killer(tmp_path, "preference", mirrored=True)
    killer.start()
    with pytest.raises(LaunchFailed):
        build("preference", run, inputs, tmp_path)
    killer.join(timeout=5)
    assert killer.killed_after is not None, "the trainer finished before it could be killed"
    folder = next(p for p in (tmp_path / "preference").iterdir() if p.is_dir())
    assert json.loads((folder / "spec.json").read_text())["mirror"]["pull"] is True
    shutil.rmtree(folder / "checkpoints")  # a new machine: nothing local
    name = f"step_{killer.killed_after:08d}"
    leftover = folder / "checkpoints" / f".{name}.partial"  # a pull killed midway
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    lines: list[str] = []
    artifact = build("preference", run, inputs, tmp_path, lines.append)
    rows = [json.loads(line) for line in (folder / "mirror.jsonl").read_text().splitlines()]
    pulls = [r for r in rows if r["event"] == "pulled"]
    assert [r["checkpoint"] for r in pulls] == [name]
    assert pulls[0]["pid"] != os.getpid()  # the main rank's process, not the step's
    assert any(f"[mirror] pid {pulls[0]['pid']} pulled {name} from s3://" in line for line in lines)
    assert not any(": pulled step_" in line for line in lines)  # the step's own pull logs "TRAINER: pulled"
    assert artifact.meta["resumed_from_step"] == killer.killed_after
    assert not leftover.exists()
    assert_same_curve(losses(artifact), losses(world["apo1"]), rel=1e-5)


def test_an_rl_rewards_trend_is_judged_by_shares_of_the_updates_not_by_its_first_and_last():
    # GRPO's per-update exact-match rewards of a tiny-learn run (docs/posttraining.md): the first
    # update 0.125, the last 0.375, and no rise once each quarter is averaged
    noisy = [0.125, 0, 0, 0.25, 0.125, 0.125, 0, 0.25, 0, 0.125, 0.375, 0.125]
    noisy += [0.125, 0.125, 0, 0, 0.125, 0.125, 0, 0, 0.125, 0.125, 0, 0.375]
    facts, said = reward_trend(noisy)
    assert facts["reward_trend"] == "flat"
    assert [m for m, _ in facts["reward_by_part"]] == [0.1042, 0.1458, 0.0833, 0.1042]
    assert said.startswith("by quarter of the updates 0.104 ± 0.038,") and "no change beyond 2 stderr" in said
    rising = [0.1, 0.12, 0.1, 0.15, 0.2, 0.18, 0.25, 0.3, 0.28, 0.35, 0.4, 0.38]
    assert reward_trend(rising)[0]["reward_trend"] == "rose"
    assert reward_trend(rising[::-1])[0]["reward_trend"] == "fell"
    assert reward_trend([0.2] * 6)[0] == {"reward_by_part": [[0.2, 0.0], [0.2, 0.0]], "reward_trend": "flat"}
    assert len(reward_trend([0.2] * 11)[0]["reward_by_part"]) == 2  # quarters from 12 updates: 3 in each
    assert reward_trend([0.0, 1.0]) == (
        {"reward_by_part": None, "reward_trend": None},
        "2 update(s): too few for a trend",
    )
    # A stderr needs 3 updates: an SAO run's 4 updates (a tiny-learn run, 2026-12-06) had halves of
    # stderr 0 and read as a fall; it is too short for any verdict
    assert reward_trend([0.45, 0.45, 0.2, 0.2]) == (
        {"reward_by_part": None, "reward_trend": None},
        "4 update(s): too few for a trend",
    )
