"""Annealing experiments: short decays from a mid-run checkpoint to compare candidate data.

The playbook's recipe: take a checkpoint from the stable phase of the main run, continue training
it on 40% of the current stage's mixture plus 60% of a candidate source with the learning rate
decaying linearly to 0 over a short run, evaluate, and compare against a baseline anneal on the
current mixture alone. The base (resolved through lineage and pinned) is tasks/base.py's; the
mixtures are tasks/mixture.py's `weights_mixture`; each run is a `pretrain` stage. Here:

- `anneal_runs` lays out the baseline (plus seed replicas of it: the same mixture with another
  data order, which measures seed noise) and one run per candidate;
- `anneal_stage` is the `pretrain` config of one run: the base stage's own TrainSpec, from the
  pinned checkpoint with its optimizer state, LR decaying linearly from the checkpoint's LR to 0;
- `compare` (pure) and `anneal_compare` (step) turn the runs' eval scores into deltas against the
  baseline with a noise estimate; the publish hook writes them to DuckDB (`anneal_comparisons`)
  and to a Prefect table artifact.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.artifact import Artifact, Inputs
from model.spec import ScheduleSpec
from tasks.base import BaseCheckpoint
from tasks.heldout import HeldoutConfig
from tasks.mixture import WeightsMixture, blend
from tasks.pretrain import StageRun, optimizer_steps
from tasks.step import many, one, step

if TYPE_CHECKING:  # at run time only where used: duckdb is not needed to read a recipe
    from infra.lineage import Lineage


class AnnealCandidate(BaseModel):
    """One candidate data source (or blend of sources) to test in an anneal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # label of its anneal run, e.g. math
    weights: dict[str, float] = Field(min_length=1)  # candidate data by recipe source name


class AnnealConfig(BaseModel):
    """The recipe's `anneal` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: tuple[AnnealCandidate, ...] = ()  # candidate data, one anneal run each
    candidate_share: float = Field(default=0.6, gt=0, lt=1)  # playbook: 60% candidate, 40% current
    tokens: int = Field(default=32768, gt=0)  # tokens per anneal run (short: a few % of the run)
    seed_runs: int = Field(default=1, ge=0)  # extra baseline runs with another data order (noise)
    checkpoint_interval: int = Field(default=100, gt=0)  # anneal runs checkpoint (resume) this often
    metric: str = "acc_norm"  # lm-eval metric compared (cloze: length-normalised accuracy)
    heldout_tokens: int = Field(default=16384, gt=0)  # held-out tokens per source for the loss deltas
    z_threshold: float = Field(default=2.0, gt=0)  # |delta| / noise above this counts as real
    base_flow: str = "smollm3"  # flow whose latest run provides the default base checkpoint
    base_deployment: str = "full"  # runs of this deployment are preferred for the default base

    @field_validator("candidates")
    @classmethod
    def _unique(cls, value: tuple[AnnealCandidate, ...]) -> tuple[AnnealCandidate, ...]:
        names = [c.name for c in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes or "baseline" in names:
            raise ValueError(f"anneal.candidates names must be unique and not 'baseline'; bad: {dupes or ['baseline']}")
        return value

    def check_sources(self, sources: Sequence[str]) -> None:
        """Every candidate names recipe sources (checked when the recipe loads)."""
        for c in self.candidates:
            unknown = sorted(set(c.weights) - set(sources))
            if unknown:
                raise ValueError(
                    f"anneal.candidates[{c.name}] names unknown source(s) {', '.join(unknown)}; "
                    f"sources: {', '.join(sources)}"
                )


# --- the anneal runs --------------------------------------------------------------------------


class AnnealRun(BaseModel):
    """One anneal launch: its label, which candidate it tests, and its mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # baseline, baseline-s1, or the candidate name
    candidate: str  # "baseline" for the baseline and its seed replicas
    mixture: WeightsMixture  # weights, tokens, sequence length and data-order seed


def anneal_runs(cfg: AnnealConfig, base: BaseCheckpoint, seed: int = 0) -> list[AnnealRun]:
    """The baseline, its seed replicas, then one run per candidate."""
    if not cfg.candidates:
        raise ValueError("anneal.candidates is empty: name at least one candidate data source")

    def mix(name: str, weights: Mapping[str, float], run_seed: int) -> WeightsMixture:
        return WeightsMixture(name=f"anneal-{name}", weights=dict(weights), tokens=cfg.tokens,
                              seq_len=base.seq_len, seed=run_seed)

    runs = [AnnealRun(label="baseline", candidate="baseline", mixture=mix("baseline", base.weights, seed))]
    runs += [
        AnnealRun(label=f"baseline-s{i}", candidate="baseline", mixture=mix("baseline", base.weights, seed + i))
        for i in range(1, cfg.seed_runs + 1)
    ]
    runs += [
        AnnealRun(label=c.name, candidate=c.name,
                  mixture=mix(c.name, blend([(base.weights, 1 - cfg.candidate_share),
                                             (c.weights, cfg.candidate_share)]), seed))
        for c in cfg.candidates
    ]
    return runs


def anneal_stage(cfg: AnnealConfig, base: BaseCheckpoint, run: AnnealRun, nproc_per_node: int = 1,
                 threads: int | None = None) -> StageRun:
    """The `pretrain` config of one anneal: the base stage's spec, from the pinned checkpoint with
    its optimizer state, LR decaying linearly from the checkpoint's LR to 0 over the run."""
    steps = optimizer_steps(cfg.tokens, base.spec.global_batch, base.seq_len)
    spec = base.spec.model_copy(update={
        "stage": run.mixture.name, "steps": steps,
        "optimizer": base.spec.optimizer.model_copy(update={"lr": base.lr}),
        "schedule": ScheduleSpec(kind="wsd", warmup_steps=0, decay_fraction=1.0, min_lr=0.0,
                                 total_steps=steps, start_step=0),
        "reset_optimizer": False, "reset_schedule": False,
        "checkpoint_interval": min(cfg.checkpoint_interval, steps), "keep_last": 1,
        "mixture_plan": "", "out_dir": "", "init_from": None,
    })
    return StageRun(spec=spec, kind="anneal", nproc_per_node=nproc_per_node, threads=threads)


def heldout_sets(cfg: AnnealConfig, base: BaseCheckpoint) -> list[HeldoutConfig]:
    """One held-out set per source of the base stage's mixture: the loss deltas show which
    domain each candidate moves, long before cloze accuracy of a small model does."""
    return [HeldoutConfig(domain=n, sources=(n,), max_tokens=cfg.heldout_tokens) for n in sorted(base.weights)]


# --- comparison -------------------------------------------------------------------------------


class CompareConfig(BaseModel):
    """What `anneal_compare` compares. Its inputs are named by run label (each a list of that
    run's score artifacts: lm-eval and held-out loss) plus `base`, the pinned checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: dict[str, str]  # run label -> candidate name ("baseline" for the baselines)
    metric: str = "acc_norm"  # lm-eval metric compared
    z_threshold: float = 2.0  # |delta| / noise above this counts as real


def compare(
    baselines: Sequence[Mapping[str, Mapping[str, float]]],
    candidates: Mapping[str, Mapping[str, Mapping[str, float]]],
    metric: str = "acc_norm",
    z_threshold: float = 2.0,
) -> list[dict[str, Any]]:
    """Score deltas of each candidate against the baseline, per task, with their noise.

    Scores are {task: {metric: value, metric_stderr: value}}: lm-eval tasks are compared on
    `metric` (higher is better), held-out sets on `loss` (lower is better).
    baselines: the scores of the baseline and of its seed replicas.
    Noise of a delta: the larger of the standard error of the difference of two scores
    (sqrt(se_c^2 + se_b^2): lm-eval's binomial stderr, or the loss's stderr over windows) and the
    seed noise of a difference of two runs (sqrt(2) x the std of the baseline replicas, when
    there are at least two). `significant` when |delta| / noise >= z_threshold.
    """
    if not baselines:
        raise ValueError("compare: no baseline scores")
    rows = []
    for name, scores in candidates.items():
        for task in sorted(scores):
            m = metric if metric in scores[task] else "loss" if "loss" in scores[task] else None
            if m is None or any(m not in b.get(task, {}) for b in baselines):
                continue
            base_values = [float(b[task][m]) for b in baselines]
            base_se = [float(b[task].get(f"{m}_stderr") or 0.0) for b in baselines]
            baseline = statistics.fmean(base_values)
            score = float(scores[task][m])
            se_b = math.sqrt(sum(s * s for s in base_se)) / len(base_se)  # stderr of the mean
            se_c = float(scores[task].get(f"{m}_stderr") or 0.0)
            stderr = math.sqrt(se_b**2 + se_c**2)
            seed_std = statistics.stdev(base_values) if len(base_values) > 1 else None
            noise = max(stderr, math.sqrt(2) * seed_std if seed_std is not None else 0.0)
            delta = score - baseline
            z = delta / noise if noise > 0 else (math.copysign(math.inf, delta) if delta else 0.0)
            lower = m == "loss"
            significant = abs(z) >= z_threshold
            rows.append({
                "candidate": name, "task": task, "metric": m, "baseline": baseline,
                "score": score, "delta": delta, "stderr": stderr, "seed_std": seed_std,
                "noise": noise, "z": z, "significant": significant,
                "better": "lower" if lower else "higher",
                "improved": significant and (delta < 0 if lower else delta > 0),
            })
    return rows


def comparison_markdown(rows: Sequence[Mapping[str, Any]], base: Mapping[str, Any]) -> str:
    lines = [
        f"# Anneal comparison from {base.get('stage', '?')} step {base.get('step', '?')} "
        f"(global step {base.get('global_step', '?')})",
        "",
        "| candidate | task | metric | baseline | score | delta | noise | z | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['candidate']} | {r['task']} | {r['metric']} | {r['baseline']:.4f} | {r['score']:.4f} | "
            f"{r['delta']:+.4f} | {r['noise']:.4f} | {r['z']:+.2f} | "
            f"{('better' if r['improved'] else 'worse') if r['significant'] else 'within noise'} |"
            for r in rows
        ),
    ]
    return "\n".join(lines) + "\n"


def build_comparison(cfg: CompareConfig, inputs: Inputs, out: Path, log=print) -> dict[str, Any]:
    """Merge each run's score artifacts (lm-eval and held-out loss) by label, then compare."""
    missing = sorted(set(cfg.candidates) - set(inputs))
    if missing:
        raise ValueError(f"anneal_compare: no scores for run(s) {', '.join(missing)}")
    scores: dict[str, dict[str, Any]] = {}
    source_of: dict[str, str] = {}
    for label in cfg.candidates:
        for art in many(inputs, label):
            scores.setdefault(label, {}).update(art.meta["scores"])
            source_of.setdefault(label, art.fingerprint)
    baselines = [s for label, s in scores.items() if cfg.candidates[label] == "baseline"]
    candidates = {cfg.candidates[label]: s for label, s in scores.items() if cfg.candidates[label] != "baseline"}
    rows = compare(baselines, candidates, cfg.metric, cfg.z_threshold)
    by_candidate = {cfg.candidates[label]: fp for label, fp in source_of.items()}
    for r in rows:
        r["eval_fingerprint"] = by_candidate[r["candidate"]]
    base = one(inputs, "base").meta
    (out / "comparison.json").write_text(json.dumps(rows, indent=2))
    markdown = comparison_markdown(rows, base)
    (out / "comparison.md").write_text(markdown)
    log("\n" + markdown)
    return {"rows": rows, "base": dict(base), "metric": cfg.metric,
            "baseline_runs": len(baselines), "candidates": sorted(candidates)}


def publish_comparison(artifact: Artifact, ws, label: str) -> None:
    """Rows to DuckDB (`anneal_comparisons`, created on first use) and a Prefect table artifact."""
    import re

    from prefect.artifacts import create_table_artifact
    from prefect.runtime import flow_run

    now = datetime.now(UTC).replace(tzinfo=None)
    run_id = str(flow_run.id) if flow_run.id else None
    base = artifact.meta["base"]
    rows = artifact.meta["rows"]
    ws.lineage().record_comparisons(
        [[artifact.fingerprint, run_id, base.get("source"), base.get("global_step"),
          r["candidate"], r["task"], r["metric"], r["baseline"], r["score"], r["delta"],
          r["stderr"], r["seed_std"], r["noise"], r["z"], r["significant"], r["better"],
          r["improved"], r["eval_fingerprint"], now] for r in rows]
    )
    table = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "eval_fingerprint"}
             for r in rows]
    key = re.sub(r"[^a-z0-9-]+", "-", f"anneal-comparison-{label}".lower())
    create_table_artifact(table=table, key=key, description="Anneal candidates vs baseline (delta, noise, z)")


@step("anneal_compare", version=2, kind="report", publish=publish_comparison)
def anneal_compare(config: CompareConfig, inputs: Inputs, out: Path, *, log=print) -> dict[str, Any]:
    """The runs' score artifacts (one input per run label) and the pinned base (input `base`) to
    the comparison."""
    return build_comparison(config, inputs, out, log)


def comparisons(lineage: Lineage, comparison: str | None = None) -> list[dict[str, Any]]:
    """Rows of `anneal_comparisons` (all, or one comparison's), newest first."""
    return lineage.comparisons(comparison)
