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
- the comparison is the experiment framework's (tasks/experiment.py, flows/ablation.py
  `add_comparison`): the baseline and its replicas and each candidate are the variants of an
  experiment of kind "anneal", compared on the runs' lm-eval scores and held-out bits per byte
  with seed noise; DuckDB `experiments` / `experiment_runs` / `experiment_results`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model.spec import ScheduleSpec
from tasks.base import BaseCheckpoint
from tasks.heldout import HeldoutConfig
from tasks.mixture import WeightsMixture, blend
from tasks.pretrain import StageRun, optimizer_steps


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
    heldout_tokens: int = Field(default=16384, gt=0)  # held-out tokens per source (bits per byte)
    confidence: float = Field(default=0.95, gt=0, lt=1)  # of each difference's interval (needs seed_runs >= 1)
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
    replica: int = 0  # seed index within its candidate (baseline-sK: K)


def anneal_runs(cfg: AnnealConfig, base: BaseCheckpoint, seed: int = 0) -> list[AnnealRun]:
    """The baseline, its seed replicas, then one run per candidate."""
    if not cfg.candidates:
        raise ValueError("anneal.candidates is empty: name at least one candidate data source")

    def mix(name: str, weights: Mapping[str, float], run_seed: int) -> WeightsMixture:
        return WeightsMixture(
            name=f"anneal-{name}", weights=dict(weights), tokens=cfg.tokens, seq_len=base.seq_len, seed=run_seed
        )

    runs = [AnnealRun(label="baseline", candidate="baseline", mixture=mix("baseline", base.weights, seed))]
    runs += [
        AnnealRun(
            label=f"baseline-s{i}", candidate="baseline", mixture=mix("baseline", base.weights, seed + i), replica=i
        )
        for i in range(1, cfg.seed_runs + 1)
    ]
    runs += [
        AnnealRun(
            label=c.name,
            candidate=c.name,
            mixture=mix(
                c.name, blend([(base.weights, 1 - cfg.candidate_share), (c.weights, cfg.candidate_share)]), seed
            ),
        )
        for c in cfg.candidates
    ]
    return runs


def anneal_stage(
    cfg: AnnealConfig, base: BaseCheckpoint, run: AnnealRun, nproc_per_node: int = 1, threads: int | None = None
) -> StageRun:
    """The `pretrain` config of one anneal: the base stage's spec, from the pinned checkpoint with
    its optimizer state, LR decaying linearly from the checkpoint's LR to 0 over the run."""
    steps = optimizer_steps(cfg.tokens, base.spec.global_batch, base.seq_len)
    spec = base.spec.model_copy(
        update={
            "stage": run.mixture.name,
            "steps": steps,
            "optimizer": base.spec.optimizer.model_copy(update={"lr": base.lr}),
            "schedule": ScheduleSpec(
                kind="wsd", warmup_steps=0, decay_fraction=1.0, min_lr=0.0, total_steps=steps, start_step=0
            ),
            "reset_optimizer": False,
            "reset_schedule": False,
            "checkpoint_interval": min(cfg.checkpoint_interval, steps),
            "keep_last": 1,
            "mixture_plan": "",
            "out_dir": "",
            "init_from": None,
        }
    )
    return StageRun(spec=spec, kind="anneal", nproc_per_node=nproc_per_node, threads=threads)


def heldout_sets(cfg: AnnealConfig, base: BaseCheckpoint) -> list[HeldoutConfig]:
    """One held-out set per source of the base stage's mixture: the loss deltas show which
    domain each candidate moves, long before cloze accuracy of a small model does."""
    return [HeldoutConfig(domain=n, sources=(n,), max_tokens=cfg.heldout_tokens) for n in sorted(base.weights)]
