"""evals/forgetting.py: the forgetting monitor's flags on a constructed forgetting case."""

from __future__ import annotations

import pytest

from evals.forgetting import forgetting_flags


def test_forgetting_is_flagged_when_general_loss_rises_past_the_threshold():
    history = [
        {"step": 0, "general": 3.00, "domain": 4.00},
        {"step": 10, "general": 3.05, "domain": 3.60},  # +1.7%: fine
        {"step": 20, "general": 3.20, "domain": 3.30},  # +6.7%: forgetting
        {"step": 30, "general": 3.45, "domain": 3.10},  # +15%
    ]
    rows = forgetting_flags(history, threshold=0.05)
    assert [r["forgetting"] for r in rows] == [False, False, True, True]
    assert rows[2]["general_rise"] == pytest.approx(0.2 / 3)
    assert [r["forgetting"] for r in forgetting_flags(history, threshold=0.2)] == [False] * 4
    # A run whose general loss keeps falling never flags.
    steady = [{"step": s, "general": 3.0 - 0.01 * s, "domain": 4.0} for s in range(5)]
    assert not any(r["forgetting"] for r in forgetting_flags(steady, 0.01))
    with pytest.raises(ValueError, match="base general loss must be > 0"):
        forgetting_flags([{"step": 0, "general": 0.0}], 0.05)
