"""Mixture files: one stage's source weights (YAML under `mixtures/`), read, checked and blended.

A mixture file holds one stage's weights by source name:

    weights:
      prose: 0.6
      code: 0.25

Mixtures are checked when the recipe loads, before any compute (`check_stages`): a source the
recipe does not define, a negative weight or a zero total is an error naming the file and the fix.
Weights that do not sum to 1 are normalised with a warning that states the original sum
(`normalised`; SmolLM3's decay stage sums to 1.0056). `blend` mixes several weightings by share
(anneals, continued pretraining). The mixture steps (tasks/mixture.py) turn a stage's weights
into the token plan the trainer reads.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import yaml

from infra.yamlfile import YamlRefused, load_yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


class MixtureWarning(UserWarning):
    """A mixture that works but deserves a look (weights renormalised, heavy repetition)."""


class MixtureError(ValueError):
    """A mixture that cannot be used; the message names the file, the source and the fix."""


class MixtureStage(Protocol):
    """What `check_stages` reads of a recipe stage (tasks/mixture.py `StageConfig`)."""

    name: str
    mixture: str


def mixture_path(path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def load_weights(path: str) -> dict[str, float]:
    """The raw weights of a mixture file (no checks beyond its shape)."""
    file = mixture_path(path)
    if not file.is_file():
        raise MixtureError(f"mixture file {path!r} not found (looked at {file}); create it or fix stages[].mixture")
    try:
        data = load_yaml(file.read_text(encoding="utf-8")) or {}
    except YamlRefused as exc:
        raise MixtureError(f"mixture file {file}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)  # no snippet of the file in the message
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise MixtureError(
            f"mixture file {file}: invalid YAML{where}: {getattr(exc, 'problem', None) or 'cannot be parsed'}"
        ) from None
    if not isinstance(data, dict) or set(data) != {"weights"} or not isinstance(data["weights"], dict):
        raise MixtureError(f"mixture file {file}: expected one mapping `weights: {{source: weight}}`")
    weights: dict[str, float] = {}
    for name, w in data["weights"].items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise MixtureError(
                f"mixture file {file}: weight of {name!r} is "
                f"{'a boolean' if isinstance(w, bool) else 'a ' + type(w).__name__}"
                ", not a finite number"
            )
        weights[str(name)] = float(w)
    return weights


def check_weights(weights: Mapping[str, float], sources: Iterable[str], where: str) -> None:
    """Errors for unknown sources, negative weights and a zero total (before any compute)."""
    known = set(sources)
    unknown = sorted(set(weights) - known)
    if unknown:
        raise MixtureError(
            f"mixture {where}: unknown source(s) {', '.join(unknown)}; the recipe's sources are "
            f"{', '.join(sorted(known))}. Add them to the recipe or fix the names."
        )
    negative = sorted(n for n, w in weights.items() if w < 0 or not math.isfinite(w))
    if negative:
        raise MixtureError(f"mixture {where}: weights must be finite and >= 0; bad: {', '.join(negative)}")
    if sum(weights.values()) <= 0:
        raise MixtureError(f"mixture {where}: the weights sum to 0; give at least one source a positive weight")


def check_stages(stages: Sequence[MixtureStage], sources: Iterable[str]) -> None:
    """Load and check every stage's mixture (called when the recipe is validated)."""
    names = list(sources)
    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            raise MixtureError(f"stage name {stage.name!r} is repeated; stage names must be unique")
        seen.add(stage.name)
        check_weights(load_weights(stage.mixture), names, f"{stage.mixture} (stage {stage.name})")


def normalised(weights: Mapping[str, float], where: str) -> tuple[dict[str, float], float]:
    """Weights scaled to sum to 1, and the original sum (with a warning when it was not 1)."""
    total = sum(weights.values())
    if not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-9):
        warnings.warn(MixtureWarning(f"mixture {where}: weights sum to {total:g}, not 1; normalised"), stacklevel=2)
    return {n: w / total for n, w in weights.items()}, total


def blend(parts: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """Sum of share x normalised weights over (weights, share) parts; parts with share 0 are
    skipped. Anneals blend (current, 1 - share) with (candidate, share); continued pretraining
    blends (new domain, 1 - replay) with (general data, replay)."""
    out: dict[str, float] = {}
    for weights, share in parts:
        if share == 0:
            continue
        total = sum(weights.values())
        if total <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"mixture weights {dict(weights)} must be >= 0 and not all 0")
        for name, w in weights.items():
            out[name] = out.get(name, 0.0) + share * w / total
    return {k: round(v, 10) for k, v in sorted(out.items()) if v > 0}
