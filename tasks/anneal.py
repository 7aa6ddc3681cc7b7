"""Annealing experiments: short decays from a mid-run checkpoint to compare candidate data.

The playbook's recipe: take a checkpoint from the stable phase of the main run, continue training
it on 40% of the current stage's mixture plus 60% of a candidate source with the learning rate
decaying linearly to 0 over a short run, evaluate, and compare against a baseline anneal on the
current mixture alone. What is here, as pure helpers plus thin steps:

- `resolve_base` finds the base checkpoint through lineage when the anneal starts: the newest
  COMPLETE checkpoint of the latest `smollm3` run (runs of the `full` deployment first) that lies
  in the stable phase of the WSD schedule (global step <= the decay start), whether it belongs to a
  finished stage or sits inside a stage folder that is still training. An explicit path or an
  artifact fingerprint may be given instead. Everything the anneal needs (the stage's mixture,
  optimizer settings, batch, the run's shards, tokenizer and eval suite) is read from the stage
  folder's `spec.json` and from lineage, so the anneal trains the same model the run does.
- `anneal_base` (step) pins that checkpoint into its own folder (hard links, else copies): the
  main run's retention (`keep_last`) may delete the original while the anneal trains.
- `weights_mixture` (step) turns a weights mapping into a mixture plan with the mixture step's own
  `build_plan` (the plan.json contract), so anneal and CPT mixtures need no YAML file in the repo.
- `anneal_runs` lays out the baseline (plus seed replicas of it: the same mixture with another
  data order, which measures seed noise) and one run per candidate as `StageRun`s for the
  `pretrain` step: init_from the pinned checkpoint with its optimizer state, LR decaying linearly
  from the checkpoint's LR to 0 over the anneal's steps.
- `compare` (pure) and `anneal_compare` (step) turn their eval scores into deltas against the
  baseline with a noise estimate; the publish hook writes them to DuckDB (`anneal_comparisons`)
  and to a Prefect table artifact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.artifact import Artifact
from infra.artifact import read_marker as read_step_marker
from infra.lineage import Lineage
from infra.workspace import Workspace
from tasks.mixture import StageConfig, build_plan
from tasks.pretrain import StageRun, TrainingConfig
from tasks.step import step

COMPARISON_TABLE = "anneal_comparisons"
COMPARISON_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {COMPARISON_TABLE} (
    comparison VARCHAR, run_id VARCHAR, base_checkpoint VARCHAR, base_global_step BIGINT,
    candidate VARCHAR, task VARCHAR, metric VARCHAR, baseline DOUBLE, score DOUBLE, delta DOUBLE,
    stderr DOUBLE, seed_std DOUBLE, noise DOUBLE, z DOUBLE, significant BOOLEAN, better VARCHAR,
    improved BOOLEAN, eval_fingerprint VARCHAR, created TIMESTAMP
)
"""


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


class BaseCheckpoint(BaseModel):
    """The resolved base of an anneal (or CPT): which checkpoint, and the run context around it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str  # complete DCP step folder (model + optimizer) or HF folder for CPT
    digest: str  # hash of its completion marker: the identity of this exact checkpoint
    stage: str  # stage it belongs to (or "hf" for an imported model)
    step: int  # step within that stage
    global_step: int  # position in the run's schedule
    lr: float  # learning rate the run was at when it saved the checkpoint
    peak_lr: float  # the run's peak learning rate
    weights: dict[str, float]  # the stage's normalised mixture weights
    seq_len: int  # the stage's sequence length
    rope_theta: float | None = None  # the stage's RoPE base override (context-extension stages)
    training: TrainingConfig  # model, batch and optimizer settings of the stage (from spec.json)
    run_id: str | None  # the run that trained it, when lineage knows it
    shards: tuple[str, ...]  # fingerprints of the run's token shards (one artifact per source)
    tokenizer: str  # fingerprint of the fertility/tokenizer artifact the shards were made with
    suite: str | None  # fingerprint of the eval suite built from the same data, if any


# --- lineage lookups --------------------------------------------------------------------------


def artifact_of(row: Mapping[str, Any]) -> Artifact:
    """An Artifact from an `artifacts` table row."""
    meta = row["meta"]
    return Artifact(kind=row["kind"], uri=row["uri"], fingerprint=row["fingerprint"],
                    meta=json.loads(meta) if isinstance(meta, str) else dict(meta or {}))


def artifacts(lineage: Lineage, fingerprints: Sequence[str]) -> list[Artifact]:
    """Artifacts by fingerprint, in the order given; a missing one is an error naming it."""
    found = []
    for fp in fingerprints:
        row = lineage.artifact(fp)
        if row is None:
            raise LookupError(f"artifact {fp[:12]} is not in lineage {lineage.path}")
        found.append(artifact_of(row))
    return found


def latest_run(lineage: Lineage, flow: str, deployment: str) -> str | None:
    """The newest run of `flow`, runs of `deployment` first (a served `smollm3/full` run beats an
    ad hoc run of the same flow)."""
    rows = lineage.query(
        "SELECT run_id FROM flow_runs WHERE flow = ? "
        "ORDER BY coalesce(deployment = ?, false) DESC, started DESC LIMIT 1",
        [flow, deployment],
    )
    return rows[0][0] if rows else None


def stage_folders(lineage: Lineage, ws: Workspace, run_id: str) -> list[Path]:
    """Pretrain stage folders of a run: its finished stages (from lineage), plus folders still
    training (no completion marker yet) whose mixture plan is one of the run's mixtures."""
    done = lineage.query(
        "SELECT DISTINCT a.uri FROM steps s JOIN artifacts a ON a.fingerprint = s.fingerprint "
        "WHERE s.run_id = ? AND s.step = 'pretrain' AND s.state IN ('completed', 'cached')",
        [run_id],
    )
    plans = {
        str(Path(uri) / "plan.json")
        for (uri,) in lineage.query(
            "SELECT DISTINCT a.uri FROM steps s JOIN artifacts a ON a.fingerprint = s.fingerprint "
            "WHERE s.run_id = ? AND s.step = 'mixture'",
            [run_id],
        )
    }
    folders = {Path(uri) for (uri,) in done}
    for folder in sorted((ws.path / "pretrain").glob("*")):
        spec = folder / "spec.json"
        if folder in folders or read_step_marker(folder) is not None or not spec.is_file():
            continue
        try:
            plan = json.loads(spec.read_text())["mixture_plan"]
        except (OSError, ValueError, KeyError):
            continue  # being written this instant: the next anneal sees it
        if plan in plans:
            folders.add(folder)
    return sorted(folders)


def decay_start(schedule: Mapping[str, Any]) -> int | None:
    """First schedule position whose LR is below the peak (WSD), None for other schedules."""
    if schedule.get("kind") != "wsd" or not schedule.get("total_steps"):
        return None
    total = int(schedule["total_steps"])
    return total - round(float(schedule["decay_fraction"]) * total)


def stable_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(global step, step folder) of the complete checkpoints of a stage folder that lie in the
    stable phase of its WSD schedule (global step <= decay start)."""
    from model.checkpoint import Checkpointer, read_marker, read_trainer_state

    spec = json.loads((folder / "spec.json").read_text())
    start = decay_start(spec["schedule"])
    if start is None:
        return []
    found = []
    for ckpt in Checkpointer(folder / "checkpoints").step_folders():
        if read_marker(ckpt) is None:
            continue  # still being written, or truncated
        try:
            global_step = int(read_trainer_state(ckpt)["global_step"])
        except (OSError, ValueError, KeyError):
            continue  # pruned between the listing and this read
        if global_step <= start:
            found.append((global_step, ckpt))
    return found


def resolve_base(
    lineage: Lineage, ws: Workspace, cfg: AnnealConfig, base: str = "", nproc_per_node: int = 1
) -> BaseCheckpoint:
    """The base checkpoint of an anneal, resolved now (see the module docstring).

    base: "" for the default (newest stable-phase checkpoint of the latest run), a checkpoint path
    (step folder, checkpoints root or stage folder) or a pretrain artifact fingerprint (prefix).
    """
    from model.checkpoint import resolve_checkpoint

    run_id = None
    if not base:
        run_id = latest_run(lineage, cfg.base_flow, cfg.base_deployment)
        if run_id is None:
            raise LookupError(
                f"no {cfg.base_flow!r} run in lineage {lineage.path}: train one first, or give the "
                "anneal an explicit base checkpoint (path or fingerprint)"
            )
        candidates = [c for folder in stage_folders(lineage, ws, run_id) for c in stable_checkpoints(folder)]
        if not candidates:
            raise LookupError(
                f"run {run_id} has no complete stable-phase checkpoint yet (before the WSD decay); "
                "wait for its first checkpoint or give an explicit base"
            )
        # Newest position in the schedule; the later-written folder breaks a tie.
        _, ckpt = max(candidates, key=lambda c: (c[0], c[1].stat().st_mtime))
    elif Path(base).exists():
        ckpt = resolve_checkpoint(base)
    else:
        row = lineage.artifact(base)
        if row is None or row["kind"] != "checkpoint":
            raise LookupError(
                f"anneal base {base!r} is neither an existing path nor the fingerprint of a "
                f"checkpoint artifact in {lineage.path}"
            )
        ckpt = resolve_checkpoint(json.loads(row["meta"])["checkpoint"])
    return describe_checkpoint(lineage, ckpt, run_id, nproc_per_node)


def describe_checkpoint(
    lineage: Lineage, ckpt: Path, run_id: str | None, nproc_per_node: int = 1
) -> BaseCheckpoint:
    """Everything an anneal or CPT needs to know about a checkpoint inside a pretrain stage folder."""
    from model.checkpoint import MARKER, read_trainer_state
    from model.schedule import lr_at
    from model.spec import ScheduleSpec

    folder = ckpt.parent.parent
    spec_file = folder / "spec.json"
    if not spec_file.is_file():
        raise FileNotFoundError(
            f"checkpoint {ckpt} is not inside a pretrain stage folder (no {spec_file}); give a "
            "checkpoint written by the pretrain step"
        )
    spec = json.loads(spec_file.read_text())
    state = read_trainer_state(ckpt)
    schedule = ScheduleSpec(**spec["schedule"])
    total = schedule.total_steps or state["global_step"] + 1
    peak = float(spec["optimizer"]["lr"])
    # The LR of the last step before the checkpoint: the anneal decays from where the run was
    # (the peak, in the stable phase), not from the next position, which past a stage's end is 0.
    lr = lr_at(max(int(state["global_step"]) - 1, 0), peak, schedule, total)
    plan_path = Path(spec["mixture_plan"])
    plan = json.loads(plan_path.read_text())
    mixture = lineage.artifact_by_uri(plan_path.parent)
    if mixture is None:
        raise LookupError(f"the mixture plan {plan_path} of {ckpt} is not in lineage {lineage.path}")
    shards = [p for p in lineage.parents(mixture["fingerprint"]) if p["kind"] == "shards"]
    if not shards:
        raise LookupError(f"mixture {mixture['fingerprint'][:12]} has no token shards in lineage")
    tok = [p for p in lineage.parents(shards[0]["fingerprint"]) if p["kind"] in ("fertility", "tokenizer")]
    if not tok:
        raise LookupError(f"shards {shards[0]['fingerprint'][:12]} have no tokenizer in lineage")
    corpora = [p for s in shards for p in lineage.parents(s["fingerprint"]) if p["kind"] == "corpus"]
    suites = sorted(
        (c for corpus in corpora for c in lineage.children(corpus["fingerprint"]) if c["step"] == "eval_suite"),
        key=lambda r: r["created"],
    )
    o = spec["optimizer"]
    training = TrainingConfig(
        model=spec["model_preset"], model_overrides=spec["model_overrides"],
        nproc_per_node=nproc_per_node, global_batch=spec["global_batch"],
        micro_batch=spec["micro_batch"], lr=peak, betas=tuple(o["betas"]), eps=o["eps"],
        weight_decay=o["weight_decay"], grad_clip=o["grad_clip"], warmup_steps=0,
        min_lr=schedule.min_lr, checkpoint_interval=spec["checkpoint_interval"], keep_last=1,
        device=spec["device"], attention_backend=spec["attention_backend"],
        num_threads=spec["num_threads"], peak_flops=spec["peak_flops"],
        log_interval=spec["log_interval"],
    )
    total_weight = sum(s["weight"] for s in plan["sources"])
    return BaseCheckpoint(
        checkpoint=str(ckpt),
        digest=hashlib.sha256((ckpt / MARKER).read_bytes()).hexdigest()[:16],
        stage=str(state.get("stage", plan["stage"])),
        step=int(state["step"]),
        global_step=int(state["global_step"]),
        lr=lr,
        peak_lr=peak,
        weights={s["name"]: s["weight"] / total_weight for s in plan["sources"]},
        seq_len=int(spec.get("seq_len") or plan["seq_len"]),
        rope_theta=spec.get("rope_theta"),
        training=training,
        run_id=run_id,
        shards=tuple(s["fingerprint"] for s in shards),
        tokenizer=tok[0]["fingerprint"],
        suite=suites[-1]["fingerprint"] if suites else None,
    )


def run_inputs(lineage: Lineage, base: BaseCheckpoint) -> tuple[list[Artifact], Artifact, Artifact]:
    """The base run's token shards, tokenizer artifact and eval suite, from lineage."""
    if base.suite is None:
        raise LookupError(
            f"no eval suite in lineage for the data of {base.checkpoint}: run the smollm3 flow up to "
            "its eval_suite step (it runs before the first stage) on the same data"
        )
    tok, suite = artifacts(lineage, [base.tokenizer, base.suite])
    return artifacts(lineage, base.shards), tok, suite


# --- pinning the base -------------------------------------------------------------------------


def link_or_copy(src: str, dst: str) -> None:
    """Hard-link a checkpoint file, else copy it. Checkpoint files are never rewritten in place
    (a re-save of a step deletes the folder first), so a link pins the data at no cost: the
    main run's retention removes its own name, the pin's name keeps the bytes."""
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def pin_checkpoint(base: BaseCheckpoint, out: Path, log=print) -> dict[str, Any]:
    """Pin the base checkpoint as `out/checkpoint/step_N` (hard links or copies) and verify the
    pinned files against the checkpoint's manifest."""
    from model.checkpoint import read_marker

    source = Path(base.checkpoint)
    target = out / "checkpoint" / source.name
    try:
        shutil.copytree(source, target, copy_function=link_or_copy)
    except (OSError, shutil.Error) as err:
        raise RuntimeError(
            f"could not copy base checkpoint {source} (pruned by the main run's retention while "
            f"copying?): {err}; rerun the anneal to resolve a newer one"
        ) from None
    if read_marker(target) is None:
        raise RuntimeError(f"the copy of base checkpoint {source} fails its manifest; rerun the anneal")
    log(f"pinned {base.stage} step {base.step} (global step {base.global_step}, lr {base.lr:.3g}) "
        f"from {source} to {target}")
    return {"checkpoint": str(target), "source": str(source), "stage": base.stage,
            "step": base.step, "global_step": base.global_step, "lr": base.lr,
            "run_id": base.run_id, "digest": base.digest}


@step("anneal_base", version=1, kind="checkpoint")
def anneal_base(config: BaseCheckpoint, inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Prefect task: pin (copy) a resolved base checkpoint."""
    return pin_checkpoint(config, out, log)


# --- mixtures ---------------------------------------------------------------------------------


class WeightsMixture(BaseModel):
    """A mixture given as weights rather than as a YAML file (anneal and CPT runs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # stage name in the plan
    weights: dict[str, float] = Field(min_length=1)  # source name -> weight (normalised)
    tokens: int = Field(gt=0)  # tokens of the run
    seq_len: int = Field(gt=0)  # sequence length
    max_epochs: float = Field(default=1000.0, gt=0)  # short runs on small data repeat by design


def blend(current: Mapping[str, float], candidate: Mapping[str, float], share: float) -> dict[str, float]:
    """(1 - share) x current mixture + share x candidate data, each normalised first."""
    out: dict[str, float] = {}
    for weights, part, where in ((current, 1 - share, "current"), (candidate, share, "candidate")):
        total = sum(weights.values())
        if total <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"{where} mixture weights {dict(weights)} must be >= 0 and not all 0")
        for name, w in weights.items():
            out[name] = out.get(name, 0.0) + part * w / total
    return {k: round(v, 10) for k, v in sorted(out.items()) if v > 0}


def build_weights_mixture(config: WeightsMixture, shards: Sequence[Artifact], out: Path, seed: int, log=print) -> dict[str, Any]:
    """Write the weights as a mixture file in `out` and plan it with the mixture step's builder."""
    import yaml

    path = out / "weights.yaml"
    path.write_text(yaml.safe_dump({"weights": dict(config.weights)}), encoding="utf-8")
    stage = StageConfig(name=config.name, mixture=str(path), tokens=config.tokens,
                        seq_len=config.seq_len, max_epochs=config.max_epochs)
    meta = build_plan(stage, shards, out, seed, log)
    return {**meta, "weights": dict(config.weights)}


@step("weights_mixture", version=1, kind="mixture")
def weights_mixture(config: WeightsMixture, inputs, out: Path, *, log=print, seed: int = 0) -> dict[str, Any]:
    """Prefect task: token shards + weights -> a mixture plan (plan.json contract)."""
    return build_weights_mixture(config, inputs, out, seed, log)


# --- the anneal runs --------------------------------------------------------------------------


class AnnealRun(BaseModel):
    """One anneal launch: its label, mixture and data seed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # baseline, baseline-s1, or the candidate name
    candidate: str  # "baseline" for the baseline and its seed replicas
    mixture: WeightsMixture
    seed: int  # data-order seed of the plan


def anneal_runs(cfg: AnnealConfig, base: BaseCheckpoint, seed: int = 0) -> list[AnnealRun]:
    """The baseline, its seed replicas, then one run per candidate."""
    if not cfg.candidates:
        raise ValueError("anneal.candidates is empty: name at least one candidate data source")

    def mix(name: str, weights: Mapping[str, float]) -> WeightsMixture:
        return WeightsMixture(name=f"anneal-{name}", weights=dict(weights), tokens=cfg.tokens,
                              seq_len=base.seq_len)

    runs = [AnnealRun(label="baseline", candidate="baseline", mixture=mix("baseline", base.weights), seed=seed)]
    runs += [
        AnnealRun(label=f"baseline-s{i}", candidate="baseline", mixture=mix("baseline", base.weights), seed=seed + i)
        for i in range(1, cfg.seed_runs + 1)
    ]
    runs += [
        AnnealRun(label=c.name, candidate=c.name, seed=seed,
                  mixture=mix(c.name, blend(base.weights, c.weights, cfg.candidate_share)))
        for c in cfg.candidates
    ]
    return runs


def anneal_stage(cfg: AnnealConfig, base: BaseCheckpoint, run: AnnealRun) -> StageRun:
    """The `pretrain` launch of one anneal: from the pinned checkpoint with its optimizer state,
    LR decaying linearly from the checkpoint's LR to 0 over the run (WSD with all-decay)."""
    stage = StageConfig(name=run.mixture.name, mixture=f"weights:{run.label}", tokens=cfg.tokens,
                        seq_len=base.seq_len, max_epochs=run.mixture.max_epochs)
    steps = max(1, math.ceil(cfg.tokens / (base.training.global_batch * base.seq_len)))
    training = base.training.model_copy(update={
        "checkpoint_interval": min(cfg.checkpoint_interval, steps), "min_lr": 0.0, "keep_last": 1,
    })
    return StageRun(
        stage=stage, training=training, kind="pretrain", steps=steps, schedule="wsd", lr=base.lr,
        warmup_steps=0, decay_fraction=1.0, total_steps=steps, start_step=0, rope_theta=base.rope_theta,
        fresh=False,
    )


def heldout_sets(cfg: AnnealConfig, shards: Sequence[Artifact]):
    """One held-out set per source of the run: the loss deltas show which domain each candidate
    moves, long before cloze accuracy of a small model does."""
    from tasks.heldout import HeldoutConfig

    names = sorted(a.meta["source"] for a in shards)
    return [HeldoutConfig(domain=n, sources=(n,), max_tokens=cfg.heldout_tokens) for n in names]


# --- comparison -------------------------------------------------------------------------------


class CompareConfig(BaseModel):
    """What `anneal_compare` compares: the eval artifacts' labels, in input order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    labels: tuple[str, ...]  # run label per score input (a run may have several: lm-eval, held-out)
    candidates: tuple[str, ...]  # candidate name per score input ("baseline" for the baselines)
    metric: str = "acc_norm"
    z_threshold: float = 2.0
    base: dict[str, Any] = {}  # the pinned base's meta (checkpoint, global step), for the record


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


def build_comparison(cfg: CompareConfig, evals: Sequence[Artifact], out: Path, log=print) -> dict[str, Any]:
    """Merge each run's score artifacts (lm-eval and held-out loss) by label, then compare."""
    if len(evals) != len(cfg.labels) or len(cfg.labels) != len(cfg.candidates):
        raise ValueError(
            f"anneal_compare: {len(evals)} score inputs for labels {cfg.labels} / candidates {cfg.candidates}"
        )
    scores: dict[str, dict[str, Any]] = {}
    candidate_of: dict[str, str] = {}
    source_of: dict[str, str] = {}
    for art, label, cand in zip(evals, cfg.labels, cfg.candidates, strict=True):
        scores.setdefault(label, {}).update(art.meta["scores"])
        candidate_of[label] = cand
        source_of.setdefault(label, art.fingerprint)
    baselines = [s for label, s in scores.items() if candidate_of[label] == "baseline"]
    candidates = {candidate_of[label]: s for label, s in scores.items() if candidate_of[label] != "baseline"}
    rows = compare(baselines, candidates, cfg.metric, cfg.z_threshold)
    by_candidate = {candidate_of[label]: fp for label, fp in source_of.items()}
    for r in rows:
        r["eval_fingerprint"] = by_candidate[r["candidate"]]
    (out / "comparison.json").write_text(json.dumps(rows, indent=2))
    markdown = comparison_markdown(rows, cfg.base)
    (out / "comparison.md").write_text(markdown)
    log("\n" + markdown)
    return {"rows": rows, "base": dict(cfg.base), "metric": cfg.metric,
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
    with ws.lineage().writer() as con:
        con.execute(COMPARISON_SCHEMA)
        con.executemany(
            f"INSERT INTO {COMPARISON_TABLE} VALUES ({', '.join('?' * 19)})",
            [[artifact.fingerprint, run_id, base.get("source"), base.get("global_step"),
              r["candidate"], r["task"], r["metric"], r["baseline"], r["score"], r["delta"],
              r["stderr"], r["seed_std"], r["noise"], r["z"], r["significant"], r["better"],
              r["improved"], r["eval_fingerprint"], now] for r in rows],
        )
    table = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "eval_fingerprint"}
             for r in rows]
    key = re.sub(r"[^a-z0-9-]+", "-", f"anneal-comparison-{label}".lower())
    create_table_artifact(table=table, key=key, description="Anneal candidates vs baseline (delta, noise, z)")


@step("anneal_compare", version=1, kind="report", publish=publish_comparison)
def anneal_compare(config: CompareConfig, inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Prefect task: eval artifacts of the baseline(s) and candidates -> the comparison."""
    return build_comparison(config, tuple(inputs), out, log)


def comparisons(lineage: Lineage, comparison: str | None = None) -> list[dict[str, Any]]:
    """Rows of `anneal_comparisons` (all, or one comparison's), newest first."""
    if not lineage.query("SELECT 1 FROM information_schema.tables WHERE table_name = ?", [COMPARISON_TABLE]):
        return []
    where, params = ("WHERE comparison = ?", [comparison]) if comparison else ("", [])
    return lineage.query_dicts(
        f"SELECT * FROM {COMPARISON_TABLE} {where} ORDER BY created DESC, candidate, task", params
    )

