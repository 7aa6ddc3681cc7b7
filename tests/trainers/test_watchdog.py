"""trainers/watchdog.py: telling the rank that froze from the ranks that wait on it."""

from __future__ import annotations

import json
import time

from infra.launchers.base import describe_hang
from trainers.watchdog import HEARTBEAT_DIR, frozen_ranks


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
