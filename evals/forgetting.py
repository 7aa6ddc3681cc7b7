"""Forgetting: the rise of a model's general held-out loss over its base's, flagged above a threshold
(continued pretraining's monitor, tasks/cpt.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def forgetting_flags(history: Sequence[Mapping[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """Each evaluation with its general-loss rise over the first row (the base model) and a
    `forgetting` flag when that relative rise exceeds `threshold`.

    history: rows {step, general, domain} in step order, the first one the base (step 0).
    """
    if not history:
        return []
    base = float(history[0]["general"])
    if not base > 0:
        raise ValueError(f"forgetting_flags: the base general loss must be > 0, got {base}")
    flagged = []
    for row in history:
        rise = (float(row["general"]) - base) / base
        flagged.append({**row, "general_rise": rise, "forgetting": rise > threshold})
    return flagged
