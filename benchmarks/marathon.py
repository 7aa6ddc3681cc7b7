"""Detection times of the long-run monitors on the tiny recipe's first stage, faults from outside.

The tiny recipe's stage 1 (its model, batch, schedule, watchdog and monitor settings from
configs/tiny.yaml) on 2 ranks through the pretrain step (`tasks.pretrain.pretrain`, the local
torchrun launcher and its supervisor), on synthetic shards; this process injects each fault:
- a rank frozen: rank 1, its torchrun and the guard get SIGSTOP after step 5 (the issue's test);
- a launch frozen whole: every process of the launch gets SIGSTOP (no watchdog can run);
- a slowed rank: from step 12 on, rank 1 runs under a CPU quota put on it from outside (a cgroup
  at 1 ms of every 8, or SIGSTOP 35 ms of every 40 without one; tests/trainers/faults.py).
Prints, per fault, seconds from the injection to the report (and to the end of the launch).

    .venv/bin/python benchmarks/marathon.py              # all three, ~5 min on 2 cores
    .venv/bin/python benchmarks/marathon.py --only slow
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.recipe import load_recipe  # noqa: E402
from flows.stage_plan import schedule_stages  # noqa: E402
from pipeline.artifact import Artifact  # noqa: E402
from tasks.pretrain import pretrain  # noqa: E402
from tests.model.conftest import write_two_source_plan  # noqa: E402
from tests.trainers.faults import Throttle  # noqa: E402


def last_step(out: Path) -> int:
    try:
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    except (OSError, IndexError, ValueError):
        return 0


def wait_step(out: Path, step: int) -> None:
    while last_step(out) < step:
        time.sleep(0.02)


def tree(out: Path) -> tuple[psutil.Process, psutil.Process, list[psutil.Process]]:
    guard = psutil.Process(int((out / ".trainer.pgid").read_text()))
    torchrun = guard.children()[0]
    return guard, torchrun, sorted(torchrun.children(), key=lambda p: int(p.environ().get("RANK", 0)))


def run(kind: str, root: Path) -> dict:
    recipe = load_recipe("tiny", ["training.nproc_per_node=2"])
    stage = schedule_stages(recipe.training, recipe.stages, recipe.seed)[0]
    plan = write_two_source_plan(root / "plan", seq_len=stage.spec.seq_len)
    stage = stage.model_copy(update={"threads": 1})
    out = root / "ws" / "pretrain" / f"{kind:0<12}"[:12]
    out.mkdir(parents=True)
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    marks: dict[str, float] = {}
    stop = threading.Event()

    def inject() -> None:
        wait_step(out, 12 if kind == "slow" else 5)
        guard, torchrun, ranks = tree(out)
        marks["step"] = last_step(out)
        marks["at"] = time.time()
        if kind == "rank":
            for p in (guard, torchrun, ranks[1]):
                p.send_signal(signal.SIGSTOP)
        elif kind == "whole":
            for p in (guard, torchrun, *ranks):
                p.send_signal(signal.SIGSTOP)
        else:  # a throttled host: rank 1 runs an eighth of the time
            throttle = Throttle(ranks[1])
            stop.wait()
            throttle.stop()

    helper = threading.Thread(target=inject, daemon=True)
    helper.start()
    started = time.time()
    try:
        pretrain(stage, mixture=mixture, out=out, log=lambda _: None)
        failed = None
    except Exception as exc:  # noqa: BLE001 - the frozen launches fail, as hung
        failed = exc
    ended = time.time()
    stop.set()
    helper.join()
    result = {"fault": kind, "injected_after_step": marks.get("step"), "stage_seconds": round(ended - started, 1)}
    if kind == "slow":
        flags = [json.loads(line) for line in (out / "monitor" / "events.jsonl").read_text().splitlines()]
        for flag in ("straggler", "throughput_drop"):
            first = next((f for f in flags if f["kind"] == flag), None)
            result[flag] = round(first["time"] - marks["at"], 1) if first else None
            if first and flag == "throughput_drop":
                result["began_at"] = first["began_at"]
    else:
        reports = sorted(
            (json.loads(p.read_text()) for p in (out / "monitor" / "hang").glob("*.json")), key=lambda r: r["time"]
        )
        result["hang_report"] = round(reports[0]["time"] - marks["at"], 1)
        result["reported_by"] = reports[0].get("by")
        result["bound_s"] = reports[0]["bound_s"]
        result["launch_ended"] = round(ended - marks["at"], 1)
        result["hung_cause"] = bool(getattr(getattr(failed, "facts", None), "hung", None))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["rank", "whole", "slow"])
    args = parser.parse_args()
    for kind in [args.only] if args.only else ["rank", "whole", "slow"]:
        with tempfile.TemporaryDirectory(prefix=f"marathon-{kind}-") as tmp:
            print(json.dumps(run(kind, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
