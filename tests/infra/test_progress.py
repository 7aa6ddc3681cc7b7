"""The one progress format (infra/progress.py): durations, ETA and when a report is due."""

from __future__ import annotations

from infra.progress import Progress, duration, eta


def test_duration_and_eta():
    assert [duration(s) for s in (0, 42.4, 65, 3725, None, float("nan"))] == ["0s", "42s", "1m05s", "1h02m", "?", "?"]
    assert eta(0, 10, 5.0) is None
    assert eta(5, 20, 10.0) == 30.0


def test_reports_every_step_of_percent_or_seconds_and_always_the_end():
    now = [0.0]
    lines, percents = [], []
    p = Progress("lm-eval", 100, "items", lines.append, percents.append, every_pct=25, every_s=60, clock=lambda: now[0])
    for _ in range(10):  # 10% in 10 s: nothing due yet
        now[0] += 1
        p.advance()
    assert lines == []
    for _ in range(15):
        now[0] += 1
        p.advance(detail=lambda: "prose 25/100")
    assert lines == ["lm-eval: 25/100 items (25%) | prose 25/100 | ETA 1m15s"] and percents == [25.0]
    now[0] += 120  # a slow item: a line after every_s even below every_pct
    p.advance()
    assert lines[-1].startswith("lm-eval: 26/100 items (26%)")
    p.advance(74)
    assert lines[-1].startswith("lm-eval: 100/100 items (100%)") and "took 2m25s" in lines[-1]
    assert percents[-1] == 100.0
    p.advance()  # nothing left: no second end line
    assert len(lines) == 3


def test_a_total_that_grows_reports_its_new_end():
    lines = []
    p = Progress("x", 2, "items", lines.append, every_pct=100, every_s=1e9)
    p.advance(2)
    p.total += 3  # more work announced (the next lm-eval request type)
    p.advance(3)
    assert [line.split(" |")[0] for line in lines] == ["x: 2/2 items (100%)", "x: 5/5 items (100%)"]
