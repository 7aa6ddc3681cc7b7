"""Experiments: a baseline and named variants, each trained with several seeds, compared with noise.

The Smol training playbook decides architecture, data and optimizer choices by ablation: change
one thing against a baseline, train small models on the same data, and trust only the evals that
carry signal at that scale. An experiment here is that, as data:

- a **variant** is a name and recipe overrides (`parse_variant("lr_low:training.optimizer.lr=1e-3")`);
  an ablation (flows/ablation.py) trains the baseline and every variant with `seeds` seeds; an
  anneal (flows/anneal.py) trains a baseline with seed replicas and one run per candidate from a
  pinned checkpoint. Each trained run is a `RunRef` (variant, seed, label);
- the `compare` step reads every run's scores (its inputs, `{label}.lm`: lm-eval artifacts in
  step order, and `{label}.heldout`: held-out BPB artifacts with one point per evaluated
  checkpoint) and
  1. decides, per task, whether the comparison can trust it: the playbook's four criteria
     (evals/quality.py `assess_runs`) over the experiment's checkpoints and seeds:
     monotonic over training, low seed-to-seed noise, above random, consistent ordering of the
     variants; an ablation requires all four to be measured and to pass;
  2. compares each variant with the baseline per task at the runs' final checkpoints: the
     difference of the seed means, the seed noise (std pooled over the two groups' seeds), a
     Student-t confidence interval and p-value with that many degrees of freedom, and whether
     the interval excludes 0. With one seed per variant the noise is unknown: no difference is
     called significant (`significant` is None) and the report says so;
- the publish hook writes DuckDB `experiments`, `experiment_runs` and `experiment_results`
  (pipeline/lineage/) and a Prefect table (the comparison) and markdown artifact (report + chart).

Metrics: lm-eval tasks are compared on the recipe's metric (acc_norm; higher is better), held-out
sets on bits per byte (lower is better; tasks/heldout.py).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from evals.quality import (
    RunSeries,
    TaskQuality,
    Thresholds,
    assess_runs,
    candidate_consistency,
)
from pipeline.artifact import Artifact, Inputs

BASELINE = "baseline"
NAME = r"^[a-z0-9][a-z0-9_-]*$"


# --- variants ---------------------------------------------------------------------------------


class Variant(BaseModel):
    """One arm of an experiment: a name and the recipe overrides that make it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME)  # label of its runs, e.g. lr_low
    overrides: tuple[str, ...] = ()  # key=value recipe overrides over the baseline's


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside brackets and quotes: `a=1,b=[1, 2],c={x: 1, y: 2}` is three items."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_variant(text: str) -> Variant:
    """`NAME:key=value[,key=value...]` as a Variant; values are YAML (lists and mappings may hold
    commas: `wide:training.model_overrides={hidden_size: 512, num_heads: 8}`)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(
            f"variant {text!r} must look like NAME:key=value[,key=value...] (e.g. lr_low:training.optimizer.lr=0.001)"
        )
    name = name.strip()
    if not re.match(NAME, name) or name == BASELINE:
        raise ValueError(f"variant name {name!r} must be lowercase letters, digits, '-' or '_' and not {BASELINE!r}")
    overrides = tuple(split_top_level(rest))
    if not overrides:
        raise ValueError(f"variant {name!r} changes nothing: give key=value overrides after the colon")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"variant {name!r}: {bad[0]!r} is not key=value")
    return Variant(name=name, overrides=overrides)


class AblationConfig(BaseModel):
    """What an ablation trains and how it is evaluated and compared (the flow's parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variants: tuple[Variant, ...] = Field(min_length=1)  # each compared against the baseline
    seeds: int = Field(default=2, ge=1)  # runs per variant (init seed and data order seed + k)
    eval_every: int | None = Field(default=None, gt=0)  # steps between kept, evaluated checkpoints; None: ~8 per run
    heldout_tokens: int = Field(default=8192, gt=0)  # held-out tokens per source for bits per byte
    lm_eval: Literal["stages", "final", "none"] = (
        "stages"  # lm-eval (cloze) after every pretrain stage, the last, or never
    )
    confidence: float = Field(default=0.95, gt=0, lt=1)  # of the difference's confidence interval
    name: str = ""  # experiment name; "" = the variant names joined by '+'

    @field_validator("variants")
    @classmethod
    def _unique(cls, value: tuple[Variant, ...]) -> tuple[Variant, ...]:
        names = [v.name for v in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"variant names must be unique; repeated: {', '.join(dupes)}")
        if BASELINE in names:
            raise ValueError(f"{BASELINE!r} is the recipe itself, not a variant name")
        return value

    @property
    def label(self) -> str:
        return self.name or "+".join(v.name for v in self.variants)


# --- the comparison step's config -------------------------------------------------------------


class RunRef(BaseModel):
    """One trained run of an experiment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # its inputs are `{label}.lm` and `{label}.heldout`
    variant: str  # the arm it belongs to (BASELINE for the baseline and its seed replicas)
    seed: int = Field(default=0, ge=0)  # seed index within its variant
    lm_steps: tuple[int, ...] = ()  # global step of each `{label}.lm` artifact, in input order


class TrustConfig(BaseModel):
    """The playbook's criteria (evals/quality.py) and which must be measured to trust a task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spearman: float = 0.5  # monotonicity over checkpoints
    snr: float = 20.0  # final score over seed noise
    margin_sigmas: float = 3.0  # distance from random, in noise units
    kendall: float = 0.5  # ordering of the variants between checkpoints
    require: tuple[Literal["monotonic", "low_noise", "above_random", "consistent"], ...] = ()

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.spearman, self.snr, self.margin_sigmas, self.kendall)


class ExperimentSpec(BaseModel):
    """The `compare` step's config: the experiment, its runs and how to judge them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["ablation", "anneal"]
    name: str  # shown in reports; the Prefect artifacts are keyed by the step's label
    baseline: str = BASELINE  # the variant the others are compared with
    variants: dict[str, tuple[str, ...]]  # variant -> what makes it (recipe overrides, candidate data)
    runs: tuple[RunRef, ...] = Field(min_length=2)
    metric: str = "acc_norm"  # lm-eval metric compared (higher is better)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    trust: TrustConfig = TrustConfig()

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        labels = [r.label for r in self.runs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"experiment {self.name}: run labels repeat: {labels}")
        unknown = sorted({r.variant for r in self.runs} - set(self.variants))
        if unknown:
            raise ValueError(f"experiment {self.name}: runs of unknown variant(s) {unknown}")
        if not any(r.variant == self.baseline for r in self.runs):
            raise ValueError(f"experiment {self.name}: no run of the baseline {self.baseline!r}")
        if len({r.variant for r in self.runs}) < 2:
            raise ValueError(f"experiment {self.name}: nothing to compare the baseline with")
        return self


# --- reading the runs' scores -----------------------------------------------------------------


@dataclass
class TaskScores:
    """One task across an experiment's runs."""

    metric: str
    better: str  # "higher" | "lower"
    randoms: list[float] = field(default_factory=list)  # the uniform guesser's score, per artifact
    points: dict[str, list[tuple[int, float, float | None, str]]] = field(default_factory=dict)
    # run label -> [(global step, value, stderr, eval fingerprint)]

    @property
    def random(self) -> float:
        return statistics.fmean(self.randoms) if self.randoms else 0.0


def run_series(cfg: ExperimentSpec, scores: TaskScores) -> list[RunSeries]:
    by_label = {r.label: r for r in cfg.runs}
    return [
        RunSeries(
            by_label[label].variant,
            by_label[label].seed,
            tuple(p[0] for p in pts),
            tuple(p[1] for p in pts),
            tuple(p[2] for p in pts) if all(p[2] is not None for p in pts) else (),
        )
        for label, pts in scores.points.items()
    ]


def _listed(value: Artifact | Sequence[Artifact] | None) -> tuple[Artifact, ...]:
    """The artifacts of one input: a list as it is, one artifact as a list of one, none as ()."""
    if value is None:
        return ()
    return (value,) if isinstance(value, Artifact) else tuple(value)


def collect(cfg: ExperimentSpec, inputs: Inputs) -> dict[str, TaskScores]:
    """Every task's points per run, from the lm-eval and held-out artifacts of the inputs."""
    tasks: dict[str, TaskScores] = {}

    def add(
        task: str,
        metric: str,
        better: str,
        random: float,
        label: str,
        step_no: int,
        values: Mapping[str, float],
        fingerprint: str,
    ) -> None:
        t = tasks.setdefault(task, TaskScores(metric, better))
        if t.metric != metric:
            raise ValueError(f"task {task}: scored on {t.metric} in one run and {metric} in another")
        t.randoms.append(random)
        stderr = values.get(f"{metric}_stderr")
        t.points.setdefault(label, []).append(
            (int(step_no), float(values[metric]), None if stderr is None else float(stderr), fingerprint)
        )

    for run in cfg.runs:
        lm = _listed(inputs.get(f"{run.label}.lm"))
        if len(lm) != len(run.lm_steps):
            raise ValueError(f"run {run.label}: {len(lm)} lm-eval input(s) but {len(run.lm_steps)} lm_steps")
        for art, step_no in zip(lm, run.lm_steps, strict=True):
            for task, values in art.meta["scores"].items():
                metric = next((m for m in (cfg.metric, "acc", "exact_match") if m in values), None)
                if metric is None or math.isnan(values[metric]):
                    continue
                if metric.startswith("acc"):
                    random = float(art.meta.get("random_accuracy") or 0.0)
                else:  # exact match: the constant guess's score (evals/harness.py random_baselines)
                    random = float((art.meta.get("random_baseline") or {}).get(task) or 0.0)
                add(task, metric, "higher", random, run.label, step_no, values, art.fingerprint)
        for art in _listed(inputs.get(f"{run.label}.heldout")):
            for point in art.meta["points"]:
                for task, values in point["scores"].items():
                    add(
                        task,
                        "bpb",
                        "lower",
                        float(art.meta["random"][task]["bpb"]),
                        run.label,
                        point["global_step"],
                        values,
                        art.fingerprint,
                    )
    for t in tasks.values():
        for label, pts in t.points.items():
            pts.sort()
            steps = [p[0] for p in pts]
            if len(set(steps)) != len(steps):
                raise ValueError(f"run {label}: two scores at the same step {steps}")
    return tasks


# --- quality and comparison -------------------------------------------------------------------


def task_quality(cfg: ExperimentSpec, tasks: Mapping[str, TaskScores]) -> dict[str, TaskQuality]:
    """The playbook's criteria per task over every run of the experiment. Ordering consistency
    across checkpoints needs two or more common checkpoints; with one (an anneal), it is the
    agreement of the task's ordering of the variants with the other tasks' (leave-one-out)."""
    complete = {name: t for name, t in tasks.items() if len(t.points) == len(cfg.runs)}
    finals: dict[str, dict[str, float]] = {}
    for name, t in complete.items():
        sign = 1.0 if t.better == "higher" else -1.0
        per_variant: dict[str, list[float]] = {}
        for s in run_series(cfg, t):
            per_variant.setdefault(s.variant, []).append(sign * s.scores[-1])
        finals[name] = {v: statistics.fmean(xs) for v, xs in per_variant.items()}
    taus = candidate_consistency(finals)
    return {
        name: assess_runs(name, run_series(cfg, t), t.random, t.better, cfg.trust.thresholds, taus.get(name))
        for name, t in complete.items()
    }


def student_t(confidence: float, df: int) -> float:
    """Two-sided critical value of Student's t."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df))


def difference(baseline: Sequence[float], variant: Sequence[float], confidence: float) -> dict[str, Any]:
    """Difference of means with the two-sample t interval (pooled seed variance).

    Noise is estimated from the spread across seeds inside each group, pooled (sum of squared
    deviations over m - 1 + n - 1 degrees of freedom); with no group of two or more it is
    unknown and so is significance. So it is when every seed scored exactly the same (a coarse
    metric, e.g. accuracy on 20 items): a spread of 0 measures the metric's resolution, not the
    absence of noise, and would make any difference "significant" with p = 0."""
    from scipy.stats import t as student

    m, n = len(baseline), len(variant)
    if not m or not n:
        raise ValueError("difference: a group without scores")
    mb, mv = statistics.fmean(baseline), statistics.fmean(variant)
    delta = mv - mb
    df = (m - 1) + (n - 1)
    out: dict[str, Any] = {
        "baseline": mb,
        "score": mv,
        "delta": delta,
        "df": df,
        "seed_std": None,
        "ci_low": None,
        "ci_high": None,
        "p_value": None,
        "significant": None,
    }
    if df == 0:
        return out
    ss = sum((x - mb) ** 2 for x in baseline) + sum((x - mv) ** 2 for x in variant)
    std = math.sqrt(ss / df)
    out["seed_std"] = std
    if std == 0:
        return out
    se = std * math.sqrt(1 / m + 1 / n)
    half = student_t(confidence, df) * se
    p = float(2 * student.sf(abs(delta) / se, df))
    out.update(ci_low=delta - half, ci_high=delta + half, p_value=p, significant=bool(p < 1 - confidence))
    return out


def compare_variants(
    cfg: ExperimentSpec, tasks: Mapping[str, TaskScores], quality: Mapping[str, TaskQuality]
) -> list[dict[str, Any]]:
    """One row per variant and task: the difference of final scores with its noise and verdict."""
    runs = {r.label: r for r in cfg.runs}
    rows = []
    for variant in (v for v in dict.fromkeys(r.variant for r in cfg.runs) if v != cfg.baseline):
        for name in sorted(quality):
            t, q = tasks[name], quality[name]
            finals = {label: pts[-1] for label, pts in t.points.items()}
            base = [finals[lb] for lb, r in runs.items() if r.variant == cfg.baseline]
            mine = [finals[lb] for lb, r in runs.items() if r.variant == variant]
            d = difference([p[1] for p in base], [p[1] for p in mine], cfg.confidence)
            errs = [p[2] for p in base + mine]
            stderr = (
                math.sqrt(
                    statistics.fmean(e * e for e in errs[: len(base)]) / len(base)
                    + statistics.fmean(e * e for e in errs[len(base) :]) / len(mine)
                )
                if all(e is not None for e in errs)
                else None
            )
            why = q.reasons(cfg.trust.thresholds, cfg.trust.require)
            trusted = q.trusted(cfg.trust.require)
            sign = 1 if t.better == "higher" else -1
            improved = None if d["significant"] is None else bool(d["significant"] and sign * d["delta"] > 0)
            rows.append(
                {
                    "variant": variant,
                    "task": name,
                    "metric": t.metric,
                    "better": t.better,
                    **d,
                    "improved": improved,
                    "stderr": stderr,
                    "trusted": trusted,
                    "why": "; ".join(why),
                    "verdict": verdict(d, improved, trusted, why),
                    "baseline_runs": len(base),
                    "variant_runs": len(mine),
                    "eval_fingerprint": mine[-1][3],
                }
            )
    return rows


def verdict(d: Mapping[str, Any], improved: bool | None, trusted: bool, why: Sequence[str]) -> str:
    if d["significant"] is None and d["seed_std"] == 0:
        call = "noise unknown (every seed scored the same)"
    elif d["significant"] is None:
        call = "noise unknown (one seed per variant)"
    elif d["significant"]:
        call = "better" if improved else "worse"
    else:
        call = "within noise"
    return call if trusted else f"untrusted eval ({'; '.join(why)}): {call}"


# --- the report -------------------------------------------------------------------------------


def _num(v: Any, fmt: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, fmt)


def report_markdown(
    cfg: ExperimentSpec,
    quality: Mapping[str, TaskQuality],
    rows: Sequence[Mapping[str, Any]],
    seeds: Mapping[str, int],
    base: Mapping[str, Any] | None = None,
) -> str:
    t = cfg.trust
    where = (
        f" from {base.get('stage', '?')} step {base.get('step', '?')} (global step {base.get('global_step', '?')})"
        if base
        else ""
    )
    lines = [
        f"# {cfg.kind.capitalize()} {cfg.name}{where}",
        "",
        "| variant | runs (seeds) | what it changes |",
        "|---|---|---|",
        *(
            f"| {v} | {seeds.get(v, 0)} | {', '.join(f'`{o}`' for o in ov) or 'the baseline'} |"
            for v, ov in cfg.variants.items()
        ),
        "",
        "## Which evals the comparison trusts",
        "",
        f"The playbook's criteria over every run's evaluated checkpoints: Spearman rho vs step >= {t.spearman}, "
        f"SNR (final / seed std) > {t.snr:g}, (final - random) > {t.margin_sigmas:g} x noise, Kendall tau of "
        f"the variants' ordering between checkpoints >= {t.kendall}"
        + (f"; required to be measured: {', '.join(t.require)}." if t.require else "."),
        "",
        "| task | metric | points | spearman | SNR (noise) | margin | kendall | trusted | why not |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, q in sorted(quality.items()):
        why = q.reasons(t.thresholds, t.require)
        lines.append(
            f"| {name} | {next((r['metric'] for r in rows if r['task'] == name), '-')} | {q.points} | "
            f"{_num(q.spearman, '.2f')} | {_num(q.snr, '.1f')} ({q.noise_source or '-'}) | "
            f"{_num(q.margin, '.1f')} | {_num(q.kendall, '.2f')} | {'yes' if q.trusted(t.require) else 'no'} | "
            f"{'; '.join(why) or '-'} |"
        )
    level = f"{cfg.confidence:.0%}"
    lines += [
        "",
        f"## Variants vs {cfg.baseline} (final checkpoints, {level} confidence)",
        "",
        "Difference = mean of the variant's seeds - mean of the baseline's; seed std pooled over both "
        f"groups; {level} interval from Student's t with that many degrees of freedom (df).",
        "",
        f"| variant | task | metric | {cfg.baseline} | variant | difference | seed std | df | {level} CI | p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ci = f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]" if r["ci_low"] is not None else "-"
        lines.append(
            f"| {r['variant']} | {r['task']} | {r['metric']} ({r['better']} better) | {r['baseline']:.4f} | "
            f"{r['score']:.4f} | {r['delta']:+.4f} | {_num(r['seed_std'])} | {r['df']} | {ci} | "
            f"{_num(r['p_value'], '.3g')} | {r['verdict']} |"
        )
    if all(r["df"] == 0 for r in rows):
        lines += [
            "",
            "One seed per variant: the seed noise is unknown, so no difference is called "
            "significant. Rerun with more seeds (`--seeds 2` or more).",
        ]
    return "\n".join(lines) + "\n"


def chart(cfg: ExperimentSpec, tasks: Mapping[str, TaskScores], quality: Mapping[str, TaskQuality], path: Path) -> bool:
    """Every task with two or more points per run: its score over training, one colour per
    variant (thin: each seed; thick: their mean). False when there is nothing to draw."""
    names = [n for n in sorted(quality) if max(len(p) for p in tasks[n].points.values()) >= 2][:6]
    if not names:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=100, squeeze=False)
    variants = list(dict.fromkeys(r.variant for r in cfg.runs))
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    by_label = {r.label: r for r in cfg.runs}
    for ax, name in zip(axes.flat, names, strict=False):
        t = tasks[name]
        for variant in variants:
            curves = [pts for lb, pts in t.points.items() if by_label[lb].variant == variant]
            for pts in curves:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colours[variant], lw=0.6, alpha=0.5)
            common = sorted(set.intersection(*(set(p[0] for p in pts) for pts in curves)))
            mean = [statistics.fmean(dict((p[0], p[1]) for p in pts)[s] for pts in curves) for s in common]
            ax.plot(common, mean, color=colours[variant], lw=1.8, label=variant)
        trusted = "trusted" if quality[name].trusted(cfg.trust.require) else "not trusted"
        ax.set_title(f"{name} ({trusted})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{t.metric} ({t.better} better)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# --- reading experiments back -----------------------------------------------------------------


def experiment_text(lineage, experiment: str | None = None, kind: str | None = None) -> str:
    """`smollm3 experiments`: the list of experiments, or one experiment's comparison."""
    if experiment is None:
        rows = lineage.experiments(kind)
        if not rows:
            return f"no experiments in {lineage.path}"
        lines = [f"{'id':<14}{'kind':<10}{'created':<21}{'variants':<30}trusted evals"]
        for r in rows:
            variants = ", ".join(json.loads(r["variants"]))
            trusted = ", ".join(json.loads(r["trusted"])) or "none"
            lines.append(
                f"{r['experiment'][:12]:<14}{r['kind']:<10}{str(r['created'])[:19]:<21}{variants:<30}{trusted}"
            )
        return "\n".join(lines)
    row = lineage.find_experiment(experiment)
    if row is None:
        raise LookupError(f"no experiment {experiment!r} in {lineage.path}; `smollm3 experiments` lists them")
    art = lineage.get(row["experiment"])
    report = art.path / "comparison.md"
    head = f"experiment {row['experiment'][:12]} (run {row['run_id']}), {art.path}\n\n"
    if report.exists():
        return head + report.read_text()
    results = lineage.experiment_results(row["experiment"])  # the folder is gone: lineage still has it
    return head + "\n".join(
        f"{r['variant']} {r['task']} {r['metric']} delta {r['delta']:+.4f}: {r['verdict']}" for r in results
    )
