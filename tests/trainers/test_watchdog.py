"""trainers/watchdog.py: telling the rank that froze from the ranks that wait on it, and from a
rank that ended or was paused whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.launchers.base import describe_hang
from model.spec import WatchdogConfig
from trainers.watchdog import EXIT_HUNG, HEARTBEAT_DIR, Watchdog, frozen_ranks


def _beat(out, rank: int, age_s: float, now: float) -> None:
    folder = out / HEARTBEAT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "host": f"node-{rank}", "pid": 100 + rank, "time": now - age_s})
    )


def test_only_a_rank_whose_heartbeat_stopped_is_frozen(tmp_path):
    now = time.time()
    for rank, age in ((0, 0.4), (1, 12.0), (2, 1.9), (3, 2.5)):  # heartbeat every 0.5 s
        _beat(tmp_path, rank, age, now)
    # silent past 4 beats (2 s) is frozen; a beat a few periods late on a loaded host is not
    assert frozen_ranks(tmp_path, 0.5, now=now) == [
        {"rank": 1, "host": "node-1", "pid": 101, "silent_s": 12.0},
        {"rank": 3, "host": "node-3", "pid": 103, "silent_s": 2.5},
    ]
    assert [f["rank"] for f in frozen_ranks(tmp_path, 0.5, now=now, exclude=1)] == [3]
    # nothing wrong: every rank beating (waiting in a collective beats too), nothing is named
    for rank in range(4):
        _beat(tmp_path, rank, 0.3, now)
    assert frozen_ranks(tmp_path, 0.5, now=now) == []
    assert frozen_ranks(tmp_path / "no-launch", 0.5, now=now) == []


def test_the_hang_names_the_frozen_rank_first():
    report = {"rank": 0, "host": "node-0", "idle_s": 31.2, "bound_s": 30.0, "why": "floor 30 s"}
    assert describe_hang(report).startswith("rank 0 on node-0 completed no step for 31.2 s")
    frozen = report | {"frozen": [{"rank": 1, "host": "node-1", "silent_s": 30.5}]}
    assert describe_hang(frozen).startswith(
        "rank 1 on node-1 frozen (heartbeat silent 30.5 s); rank 0 on node-0 waiting on it completed no step for 31.2 s"
    )


def test_a_rank_that_ended_is_not_frozen_however_old_its_last_heartbeat(tmp_path):
    """A real watchdog's `stop()` (training ended) writes a last heartbeat, phase `ended`: a rank
    slow to exit on a loaded machine is never named frozen for it."""
    watchdog = Watchdog(WatchdogConfig(floor_s=5.0, heartbeat_s=0.1), tmp_path, 0, "stage1").start()
    watchdog.completed(1, 0.01)
    watchdog.stop()
    beat = json.loads((tmp_path / HEARTBEAT_DIR / "rank0.json").read_text())
    assert (beat["phase"], beat["step"]) == ("ended", 1)
    assert frozen_ranks(tmp_path, 0.1, now=time.time() + 600) == []


def test_a_rank_names_its_node_when_the_launcher_gives_it_one(tmp_path, monkeypatch):
    """In a Kubernetes pod the hostname is the pod's: the node's name comes in SMOLLM3_NODE (the
    downward API, infra/launchers/kubernetes.py), which is what an anti-affinity can exclude."""
    monkeypatch.setenv("SMOLLM3_NODE", "ip-10-1-2-3.ec2.internal")
    watchdog = Watchdog(WatchdogConfig(floor_s=5.0, heartbeat_s=0.1), tmp_path, 0, "stage1").start()
    watchdog.stop()
    assert json.loads((tmp_path / HEARTBEAT_DIR / "rank0.json").read_text())["host"] == "ip-10-1-2-3.ec2.internal"


CHILD = """
import sys, time
from pathlib import Path
from model.spec import WatchdogConfig
from trainers.watchdog import Watchdog
config = WatchdogConfig(floor_s=2.0, multiple=2.0, heartbeat_s=0.1, startup_s=2.0, grace_s=2.0)
watchdog = Watchdog(config, Path(sys.argv[1]), 0, "stage1").start()
for step in range(1, 60):
    watchdog.completed(step, 0.1)
    if step == 5:
        print("stepping", flush=True)
    time.sleep(0.1)
watchdog.stop()
"""


def test_a_rank_paused_whole_from_outside_does_not_count_the_pause_as_a_hang(tmp_path):
    """A process stepping every 0.1 s (bound: the 2 s floor) is stopped from outside for 3.5 s, as
    a loaded or paused machine stops it, then continued: its watchdog thread wakes 3.5 s late and
    leaves that out of the idle time (its process did not run), so it does not fire (exit 5) and
    the process ends normally. A rank waiting on a frozen peer runs, so it still fires
    (tests/trainers/test_marathon.py)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.stdout.readline().strip() == "stepping"
    child.send_signal(signal.SIGSTOP)
    time.sleep(3.5)
    child.send_signal(signal.SIGCONT)
    assert child.wait(timeout=60) == 0
    assert not (tmp_path / "monitor" / "hang").exists()


PULL_CHILD = """
import sys, time
from pathlib import Path
from model.spec import WatchdogConfig
from trainers.watchdog import Watchdog
config = WatchdogConfig(heartbeat_s=0.1, startup_s=1.0, grace_s=2.0)
watchdog = Watchdog(config, Path(sys.argv[1]), 0, "stage1").start()
watchdog.begin_phase("pull")
for _ in range(15):  # a 3 s pull; bytes arrive every 0.2 s, or never
    time.sleep(0.2)
    if sys.argv[2] == "progress":
        watchdog.advanced()
watchdog.end_phase()
watchdog.stop()
"""


@pytest.mark.parametrize("pull", ["progress", "stalled"])
def test_a_checkpoint_pull_is_bounded_by_its_stalls_not_its_length(tmp_path, pull):
    """A rank's 3 s pull under a 1 s startup bound: while bytes arrive (`advanced`) the watchdog
    stays silent and the rank ends normally; a pull where nothing arrives is ended as hung at
    the bound, its report naming the pull phase."""
    child = subprocess.run(
        [sys.executable, "-c", PULL_CHILD, str(tmp_path), pull],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    if pull == "progress":
        assert child.returncode == 0, child.stderr[-2000:]
        assert not (tmp_path / "monitor" / "hang").exists()
    else:
        assert child.returncode == EXIT_HUNG, child.stderr[-2000:]
        report = json.loads((tmp_path / "monitor" / "hang" / "rank0.json").read_text())
        assert report["phase"] == "pull" and "pull's last progress" in report["why"]
