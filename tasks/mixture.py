"""Mixtures: per-stage source weights (YAML under `mixtures/`) to a token plan for the trainer.

A mixture file holds one stage's weights by source name:

    weights:
      prose: 0.6
      code: 0.25

The recipe's `stages` name a mixture file, a token budget and a sequence length each. Mixtures are
checked when the recipe loads, before any compute (curation/mixtures.py: a source the recipe does
not define, a negative weight or a zero total is an error naming the file and the fix; weights
that do not sum to 1 are normalised with a warning that states the original sum, SmolLM3's decay
stage sums to 1.0056). The mixture step then computes each source's token budget for the stage and its
expected epochs over the tokens available, warns when a source repeats more than the stage's
`max_epochs`, and writes `plan.json`, the contract the trainer (model/token_shards.py) reads:

    {"stage", "seed", "seq_len", "tokens", "vocab_size", "eos_id", "token_dtype",
     "sources": [{"name", "weight", "files", "available_tokens", "budget_tokens",
                  "expected_epochs"}]}

Sources with weight 0 are left out of `sources` (listed in the meta as unused).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from curation.mixtures import MixtureError, MixtureWarning, check_weights, load_weights, mixture_path, normalised
from infra.files import path_for_file
from model.spec import StageSettings
from pipeline.artifact import Artifact, operational
from pipeline.step import step


class StageConfig(StageSettings):
    """One pretraining stage of the recipe's `stages` list: its data, its place in the schedule,
    and any training setting of its own (`StageSettings`, model/spec.py: every `training` field,
    optional; None = the training section's)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # stage id, e.g. stage1
    mixture: str  # YAML file of source weights; relative paths are from the repository root
    tokens: int = Field(gt=0, le=10**15)  # tokens trained on in this stage (SmolLM3's whole run: 1.1e13)
    seq_len: int = Field(gt=0)  # training sequence length in tokens
    max_epochs: float = Field(default=4.0, gt=0)  # warn when a source repeats more than this
    # Training: `pretrain` stages share one WSD schedule; `long_context` stages follow with a raised
    # seq_len and RoPE theta, a fresh optimizer and a fresh cosine schedule (tasks/pretrain.py);
    # `reasoning` stages (mid-training on reasoning traces, before post-training) come last, with
    # a fresh optimizer and cosine schedule of their own too.
    kind: Literal["pretrain", "long_context", "reasoning"] = "pretrain"
    rope_theta: float | None = Field(default=None, gt=0)  # RoPE base override for this stage
    lr_scale: float = Field(default=1.0, gt=0)  # long_context, reasoning: peak LR = training.lr x this
    warmup_steps: int = Field(default=0, ge=0)  # long_context, reasoning: warmup of the fresh schedule
    # The node count of its launch: a long-context stage whose global batch is smaller than the
    # main stages' DP size runs on fewer nodes (docs/scale.md). Operational.
    nodes: int | None = operational(None, gt=0)


class MixtureSpec(BaseModel):
    """The mixture step's config: what a stage's token plan depends on (the training-only fields
    of the stage are left out, so changing them does not replan) and the data-order seed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # stage name
    mixture: str  # YAML file of source weights (its content is in the fingerprint)
    tokens: int = Field(gt=0)  # tokens of the stage
    seq_len: int = Field(gt=0)  # sequence length
    seed: int = 0  # seed of the data order the trainer draws
    max_epochs: float = operational(4.0, gt=0)  # warn above this many repeats (a warning only)

    @classmethod
    def of(cls, stage: StageConfig, seed: int) -> MixtureSpec:
        return cls(
            name=stage.name,
            mixture=stage.mixture,
            tokens=stage.tokens,
            seq_len=stage.seq_len,
            seed=seed,
            max_epochs=stage.max_epochs,
        )


def mixture_digest(config: MixtureSpec) -> str:
    """Content hash of the mixture file, so editing the YAML changes the step's fingerprint."""
    return hashlib.sha256(mixture_path(config.mixture).read_bytes()).hexdigest()[:16]


class WeightsMixtureSpec(BaseModel):
    """A mixture given as weights rather than as a YAML file (anneal, CPT and ablation runs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # stage name in the plan
    weights: dict[str, float] = Field(min_length=1)  # source name -> weight (normalised)
    tokens: int = Field(gt=0)  # tokens of the run
    seq_len: int = Field(gt=0)  # sequence length
    seed: int = 0  # seed of the data order
    max_epochs: float = operational(1000.0, gt=0)  # short runs on small data repeat by design


@step("weights_mixture", version=2, kind="mixture")
def weights_mixture(
    config: WeightsMixtureSpec, shards: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """Token shards and weights to a mixture plan (the plan.json contract): the weights written
    as a mixture file in `out`, planned by the mixture step."""
    path = out / "weights.yaml"
    path.write_text(yaml.safe_dump({"weights": dict(config.weights)}), encoding="utf-8")
    spec = MixtureSpec(
        name=config.name,
        mixture=str(path),
        tokens=config.tokens,
        seq_len=config.seq_len,
        seed=config.seed,
        max_epochs=config.max_epochs,
    )
    meta = mixture(spec, shards, out=out, log=log)
    return {**meta, "weights": dict(config.weights)}


@step("mixture", version=2, kind="mixture", extra=mixture_digest)
def mixture(config: MixtureSpec, shards: tuple[Artifact, ...], *, out: Path, log=print) -> dict[str, Any]:
    """Every source's token shards to one stage's mixture plan: token budgets and expected epochs
    per source, written to `plan.json`; returns the meta."""
    by_source = {a.meta["source"]: a for a in shards if a.kind == "shards"}
    raw = load_weights(config.mixture)
    where = f"{config.mixture} (stage {config.name})"
    check_weights(raw, by_source, where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights, original_sum = normalised(raw, where)
    notes = [str(w.message) for w in caught]
    for note in notes:
        warnings.warn(MixtureWarning(note), stacklevel=2)
    meta_of = [a.meta for a in by_source.values()]
    for key in ("vocab_size", "eos_id", "token_dtype"):
        values = {m[key] for m in meta_of}
        if len(values) > 1:
            raise MixtureError(
                f"mixture {where}: shards disagree on {key} ({sorted(values)}); tokenize every "
                "source with the same tokenizer"
            )
    first = meta_of[0]
    sources: list[dict[str, Any]] = []
    for name in sorted(weights, key=lambda n: (-weights[n], n)):
        weight = weights[name]
        if weight == 0:
            continue
        art = by_source[name]
        available = int(art.meta["tokens"])
        budget = int(round(weight * config.tokens))
        if available == 0:
            raise MixtureError(f"mixture {where}: source {name!r} has weight {weight:g} but no tokens")
        epochs = budget / available
        if epochs > config.max_epochs:
            note = (
                f"mixture {where}: source {name!r} would repeat {epochs:.1f} times "
                f"({budget} of {available} tokens), above max_epochs {config.max_epochs:g}; "
                "lower its weight, the stage's tokens, or add data"
            )
            warnings.warn(MixtureWarning(note), stacklevel=2)
            notes.append(note)
        sources.append(
            {
                "name": name,
                "weight": weight,
                # relative to this folder (./ or ../) inside the workspace, so it can move
                "files": [path_for_file(art.path / f, out / "plan.json", out.parent.parent) for f in art.meta["files"]],
                "available_tokens": available,
                "budget_tokens": budget,
                "expected_epochs": round(epochs, 4),
            }
        )
    plan = {
        "stage": config.name,
        "seed": config.seed,
        "seq_len": config.seq_len,
        "tokens": config.tokens,
        "vocab_size": first["vocab_size"],
        "eos_id": first["eos_id"],
        "token_dtype": first["token_dtype"],
        "sources": sources,
    }
    (out / "plan.json").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    for note in notes:
        log(f"WARNING {note}")
    log(f"mixture {config.name}: {len(sources)} sources, {config.tokens} tokens at seq_len {config.seq_len}")
    return {
        "stage": config.name,
        "plan": str(out / "plan.json"),
        "tokens": config.tokens,
        "seq_len": config.seq_len,
        "original_weight_sum": original_sum,
        "budgets": {s["name"]: s["budget_tokens"] for s in sources},
        "expected_epochs": {s["name"]: s["expected_epochs"] for s in sources},
        "unused": sorted(n for n, w in weights.items() if w == 0) + sorted(set(by_source) - set(weights)),
        "warnings": notes,
    }
