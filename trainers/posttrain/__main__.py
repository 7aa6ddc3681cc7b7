"""One post-training trainer on every rank of a launch: `python -m trainers.posttrain SPEC.json`.

The post-training steps launch it through infra/launchers (trainers/posttrain/launch.py), e.g.

    torchrun --nproc-per-node 8 -m trainers.posttrain spec.json
    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 \\
        -m trainers.posttrain spec.json

`spec.json` is a `TrainerSpec` (trainer, its recipe section, policy and data folders, out folder,
seed, device). TRL's trainers pick up the torchrun/accelerate environment (DDP, or FSDP and
DeepSpeed per the accelerate config). Like trainers/pretrain.py: a rank ends itself when torchrun dies
(`protect_rank`), rank 0 leases the out folder first (exit 4 when another trainer holds it),
only rank 0 prints progress and writes `result.json` (the step's meta) last, after its S3
uploader (with `spec.mirror`) verified every checkpoint in the bucket. A stop signal
(SIGUSR1 before a time limit, SIGTERM at preemption or eviction) saves the step being trained and
exits 75, like the pretraining trainer (trainers/rank_signals.py).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

from infra.guard import LeaseHeld, StageLease, protect_rank
from trainers.rank_signals import EXIT_STOPPED, EXIT_TRANSIENT, StopRequested, TransientFailure, pull_checkpoint

EXIT_LEASE_HELD = 4  # infra/launchers/base.py EXIT_CODES, as trainers/pretrain.py


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainers.posttrain SPEC.json  (under torchrun or accelerate launch)", file=sys.stderr)
        return 2
    protect_rank()  # first: a rank must not outlive torchrun, even during startup
    from infra.files import write_atomic
    from pipeline.child import PROGRESS_MARK
    from trainers.posttrain.common import is_main
    from trainers.posttrain.launch import RESULT, TRAINERS, TrainerSpec

    spec = TrainerSpec.load(Path(argv[0]))
    out = Path(spec.out)
    lease = None
    if is_main():
        try:
            lease = StageLease(out).acquire()
        except LeaseHeld as err:
            print(f"error: LeaseHeld: {err}", file=sys.stderr)
            return EXIT_LEASE_HELD
        # TRL's unpublished checkpoint folders are what a killed attempt was writing: never used.
        for partial in (out / "trainer").glob("checkpoint-*"):
            shutil.rmtree(partial, ignore_errors=True)
    uploader = None
    try:
        pull_mirror(spec, out)  # a cluster launch: its main rank brings a lost checkpoint back
        uploader = start_uploader(spec, out) if is_main() else None
        module, fn, _ = TRAINERS[spec.trainer]
        train = getattr(importlib.import_module(module), fn)
        main_rank = is_main()
        meta = train(
            spec.section,
            Path(spec.policy),
            Path(spec.data),
            out,
            seed=spec.seed,
            device=spec.device,
            log=(lambda line: print(line, flush=True)) if main_rank else (lambda _: None),
            progress=(lambda p: print(f"{PROGRESS_MARK}{p:.2f}", flush=True)) if main_rank else None,
            **trainer_hooks(spec),
        )
        if uploader is not None:  # the step ends with every checkpoint verified on S3, or fails
            uploader.close()
        if main_rank:
            write_atomic(out / RESULT, json.dumps(meta, default=str))
            print(json.dumps(meta, default=str), flush=True)
    except StopRequested as err:  # a signal: the step it came at is saved, a restart resumes there
        if is_main():
            print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except TransientFailure as err:  # S3 or the network: the step's retry launches again
        print(f"error: TransientFailure: {err}", file=sys.stderr, flush=True)
        return EXIT_TRANSIENT
    finally:
        if uploader is not None:
            uploader.abandon()  # a failing or stopping rank does not wait for S3 (no-op once closed)
        _end_process_group()
        if lease is not None:
            lease.release()
    return 0


def pull_mirror(spec, out: Path, poll_s: float = 1.0) -> None:
    """With `spec.mirror.pull` (a cluster launch): the main rank pulls the newest checkpoint that
    verifies from the mirror into the shared `{out}/checkpoints` when that holds no complete one
    (infra/storage.py `pull_for_resume`: a `.partial` folder renamed into place, its marker last),
    then writes `{out}/.pulled`, which the step removed before the launch; the other ranks wait
    for that file (no process group yet: the trainers' own launch makes it) for as long as the
    pull's bytes keep arriving (`wait_for_pull`: a stall of the collective timeout ends the wait),
    so no rank looks for a checkpoint to resume before the pull ended. A pull that fails on S3
    or the network, or stalls, raises `TransientFailure` (exit 6, retried by the step); any
    other failure ends the main rank, and with it the launch. Nothing without it: the step
    pulled before a local launch, or there is no mirror."""
    if spec.mirror is None or not spec.mirror.pull:
        return
    from infra.files import write_atomic
    from infra.launchers.fabric import COLLECTIVE_TIMEOUT_ENV
    from infra.storage import MIRROR_RECORD, PULLED, wait_for_pull
    from trainers.posttrain.common import CHECKPOINTS, is_main

    if is_main():
        log = lambda line: print(line, flush=True)  # noqa: E731
        pull_checkpoint(spec.mirror, out / CHECKPOINTS, out / MIRROR_RECORD, log)
        write_atomic(out / PULLED, str(os.getpid()))
        return
    stall = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "1800"))
    try:
        wait_for_pull(out / PULLED, out / CHECKPOINTS, stall_s=stall, poll_s=poll_s)
    except TimeoutError as exc:
        raise TransientFailure(str(exc)) from exc


def start_uploader(spec, out: Path):
    """The main rank's S3 uploader of the step's checkpoints (`spec.mirror`), or None: it uploads
    the complete local ones first, then each one `publish_checkpoint` hands it."""
    if spec.mirror is None:
        return None
    from infra.storage import MIRROR_RECORD, CheckpointUploader
    from trainers.posttrain.common import CHECKPOINTS, use_uploader

    uploader = CheckpointUploader(
        spec.mirror.uri,
        spec.mirror.storage,
        out / CHECKPOINTS,
        record=out / MIRROR_RECORD,
        log=lambda line: print(line, flush=True),
    ).start()
    use_uploader(uploader)
    return uploader


def trainer_hooks(spec) -> dict:
    """How a trainer reports its curves: TRL trainers through a callback, SAO (its own loop) is
    handed the tracker and its folder."""
    from trainers.posttrain.common import tracker_callback

    if spec.trainer == "sao":
        return {"tracker": (spec.tracker, Path(spec.tracker_dir)) if spec.tracker_dir else None}
    hooks = [tracker_callback(spec.tracker, Path(spec.tracker_dir), spec.trainer)] if spec.tracker_dir else []
    return {"callbacks": hooks}


def _end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from infra.exit import exit_process

    exit_process(main(sys.argv[1:]))  # sys.exit without the final collections over torch's objects
