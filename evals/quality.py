"""Eval-task quality: which tasks give signal at this scale (the playbook's four criteria).

Per task, over a run's checkpoints (and, when there is one, an anneal comparison):
- monotonicity: Spearman rho of score vs training step >= 0.5 (the score should grow with training);
- noise: SNR = mean score / its noise > 20, the noise being the std across seeds when seed runs
  exist, else the standard error of each score (lm-eval's binomial stderr, or a bootstrap of
  per-item results);
- margin above random: final score - random > 3 x noise;
- ranking consistency: Kendall tau, either between the rankings of several models at successive
  steps, or between this task's ranking of anneal candidates and the consensus of the other tasks
  (threshold 0.5 here: the playbook names the statistic, not a cut-off).

A task is kept when it passes every criterion that could be measured. An experiment (an ablation
or an anneal, evals/experiments.py) assesses each task over all its runs (`assess_runs`): the mean
Spearman rho over the runs' checkpoints, the seed noise pooled over its variants, the ordering
of the variants at successive checkpoints; it may require criteria to be measured (`trust`).
Lower-is-better metrics (held-out bits per byte) are assessed with `better="lower"`. The functions
are pure and take plain lists; `run_series` reads a run's scores from lineage, and

    smollm3 eval-quality [WORKSPACE] [--run RUN_ID] [--metric acc_norm]

prints the table and, under each dropped task, which criteria failed with their values.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    spearman: float = 0.5  # playbook: monotonicity
    snr: float = 20.0  # playbook: low noise
    margin_sigmas: float = 3.0  # playbook: score - random > 3 x std
    kendall: float = 0.5  # our cut-off for ranking consistency


@dataclass(frozen=True)
class TaskSeries:
    """One task's scores over a run's checkpoints."""

    task: str
    steps: tuple[float, ...]  # training step of each checkpoint, increasing
    scores: tuple[float, ...]  # score at each step
    stderr: tuple[float, ...] = ()  # per-score standard error (binomial or bootstrap), if known
    seed_scores: tuple[tuple[float, ...], ...] = ()  # final-checkpoint scores of several seeds
    random: float = 0.0  # score of random guessing (1 / choices for multiple choice)
    # model -> scores at the same steps (several models trained side by side), for ranking consistency
    models: Mapping[str, Sequence[float]] = field(default_factory=dict)


# The statistics are computed here, in plain Python, rather than with scipy.stats: importing it
# takes a second or more (two on a busy 2-core machine), longer than the whole command should,
# and a run has tens of checkpoints, not millions. They equal scipy's `rankdata`, `spearmanr`
# and `kendalltau` (tau-b) (tests/evals/test_quality.py compares them).


def rankdata(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing the average of their ranks (scipy's `rankdata` 'average')."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else math.nan


def monotonicity(steps: Sequence[float], scores: Sequence[float]) -> float:
    """Spearman rho of score vs step; 0 when either is constant (no ranking to correlate)."""
    if len(steps) != len(scores):
        raise ValueError(f"monotonicity: {len(steps)} steps but {len(scores)} scores")
    if len(scores) < 2 or len(set(scores)) < 2 or len(set(steps)) < 2:
        return 0.0
    rho = _pearson(rankdata(steps), rankdata(scores))
    return 0.0 if math.isnan(rho) else float(rho)


def bootstrap_std(item_scores: Sequence[float], samples: int = 1000, seed: int = 0) -> float:
    """Std of the mean of per-item scores (0/1 correctness) under bootstrap resampling."""
    import numpy as np

    values = np.asarray(item_scores, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap_std: no item scores")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(samples, values.size))].mean(axis=1)
    return float(means.std(ddof=1))


def noise_std(series: TaskSeries) -> float | None:
    """Seed std at the final checkpoint when seeds exist, else the final score's stderr."""
    finals = [s[-1] if isinstance(s, Sequence) else s for s in series.seed_scores]
    if len(finals) >= 2:
        return statistics.stdev(finals)
    if series.stderr:
        return float(series.stderr[-1])
    return None


def snr(signal: float, noise: float | None) -> float | None:
    """Signal-to-noise ratio; inf for a noiseless non-zero signal, None when noise is unknown."""
    if noise is None:
        return None
    if noise == 0:
        return math.inf if signal else 0.0
    return abs(signal) / noise


def margin_sigmas(score: float, random: float, noise: float | None) -> float | None:
    """(score - random) in units of the noise."""
    if noise is None:
        return None
    if noise == 0:
        return math.inf if score > random else -math.inf if score < random else 0.0
    return (score - random) / noise


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall tau-b of two score lists over the same items; 0 when either is constant."""
    if len(a) != len(b):
        raise ValueError(f"kendall: {len(a)} vs {len(b)} items")
    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return 0.0
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue  # tied in both: counts in neither denominator term
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    tau = (concordant - discordant) / denom if denom else math.nan
    return 0.0 if math.isnan(tau) else float(tau)


def ranking_consistency(models: Mapping[str, Sequence[float]]) -> float | None:
    """Mean Kendall tau between the models' rankings at successive steps (None: < 2 models)."""
    names = sorted(models)
    if len(names) < 2:
        return None
    n = min(len(models[m]) for m in names)
    if n < 2:
        return None
    taus = [kendall([models[m][i] for m in names], [models[m][i + 1] for m in names]) for i in range(n - 1)]
    return statistics.fmean(taus)


def candidate_consistency(by_task: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Per task, Kendall tau between its ranking of anneal candidates and the mean ranking of the
    other tasks (leave-one-out consensus). by_task: task -> {candidate: score (higher better)}."""
    out: dict[str, float] = {}
    tasks = sorted(by_task)
    cands = sorted(set.intersection(*(set(v) for v in by_task.values()))) if by_task else []
    if len(tasks) < 2 or len(cands) < 2:
        return out
    ranks = {t: rankdata([by_task[t][c] for c in cands]) for t in tasks}
    for t in tasks:
        others = [ranks[o] for o in tasks if o != t]
        consensus = [statistics.fmean(r[i] for r in others) for i in range(len(cands))]
        out[t] = kendall(list(ranks[t]), consensus)
    return out


CRITERIA = ("monotonic", "low_noise", "above_random", "consistent")


@dataclass(frozen=True)
class TaskQuality:
    task: str
    points: int
    final: float
    spearman: float | None  # None: fewer than 3 checkpoints in every run
    snr: float | None
    margin: float | None  # in noise units
    kendall: float | None
    checks: dict[str, bool | None]  # criterion -> pass (None: not measurable here)
    better: str = "higher"  # "lower" for losses and bits per byte
    noise_source: str | None = None  # "seeds" (std across seed runs) or "stderr" (of each score)

    @property
    def keep(self) -> bool:
        measured = [v for v in self.checks.values() if v is not None]
        return bool(measured) and all(measured)

    def why(self, thresholds: Thresholds = Thresholds()) -> tuple[list[str], list[str]]:
        """(the criteria that failed, with the values and thresholds; those not measurable here
        and why) in words: what `keep: no` rests on."""

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else ("inf" if math.isinf(v) else format(v, fmt))

        failed, unmeasured = [], []
        c = self.checks
        if c["monotonic"] is False:
            failed.append(
                f"not monotonic: Spearman rho {self.spearman:.2f} < {thresholds.spearman:g} over "
                f"{self.points} checkpoints"
            )
        elif c["monotonic"] is None:
            unmeasured.append(f"monotonicity (needs 3+ checkpoints, has {self.points})")
        if c["low_noise"] is False:
            failed.append(f"noisy: SNR {num(self.snr, '.1f')} <= {thresholds.snr:g}")
        elif c["low_noise"] is None:
            unmeasured.append("noise (no stderr and no seed runs)")
        if c["above_random"] is False:
            failed.append(
                f"too close to random: margin {num(self.margin, '.1f')} sigma <= {thresholds.margin_sigmas:g} sigma"
            )
        elif c["above_random"] is None:
            unmeasured.append("margin above random (no noise estimate)")
        if c["consistent"] is False:
            failed.append(f"inconsistent ranking: Kendall tau {num(self.kendall, '.2f')} < {thresholds.kendall:g}")
        elif c["consistent"] is None:
            unmeasured.append("ranking consistency (needs an anneal comparison or several models)")
        return failed, unmeasured

    def trusted(self, require: Sequence[str] = ()) -> bool:
        """Kept, and every criterion in `require` was measured."""
        return self.keep and all(self.checks[c] is not None for c in require)

    def reasons(self, thresholds: Thresholds = Thresholds(), require: Sequence[str] = ()) -> list[str]:
        """Why the task is not trusted, one phrase per failed or missing criterion ([] = trusted)."""
        out = []
        c, t = self.checks, thresholds
        noise = f" ({self.noise_source})" if self.noise_source else ""
        if c["monotonic"] is False:
            out.append(f"not monotonic (rho {self.spearman:.2f} < {t.spearman})")
        if c["low_noise"] is False:
            out.append(f"noisy (SNR {self.snr:.1f} <= {t.snr:g}{noise})")
        if c["above_random"] is False:
            out.append(f"not above random ({self.margin:.1f} sigma <= {t.margin_sigmas:g})")
        if c["consistent"] is False:
            out.append(f"inconsistent ordering (tau {self.kendall:.2f} < {t.kendall})")
        missing = {
            "monotonic": "monotonicity unmeasured (fewer than 3 checkpoints)",
            "low_noise": "noise unmeasured (one seed, no stderr)",
            "above_random": "margin unmeasured (no noise)",
            "consistent": "ordering unmeasured (one variant or one checkpoint)",
        }
        out += [missing[k] for k in require if c[k] is None]
        if not any(v is not None for v in c.values()):
            out.append("nothing measurable")
        return out


def assess(series: TaskSeries, thresholds: Thresholds = Thresholds(), kendall_tau: float | None = None) -> TaskQuality:
    """The four criteria for one task. kendall_tau: an externally measured consistency (anneal
    candidates); otherwise it comes from `series.models` when several models are given."""
    if not series.scores:
        raise ValueError(f"task {series.task!r} has no scores")
    rho = monotonicity(series.steps, series.scores)
    noise = noise_std(series)
    final = float(series.scores[-1])
    ratio = snr(final, noise)
    margin = margin_sigmas(final, series.random, noise)
    tau = kendall_tau if kendall_tau is not None else ranking_consistency(series.models)
    checks = {
        "monotonic": rho >= thresholds.spearman if len(series.scores) >= 3 else None,
        "low_noise": None if ratio is None else ratio > thresholds.snr,
        "above_random": None if margin is None else margin > thresholds.margin_sigmas,
        "consistent": None if tau is None else tau >= thresholds.kendall,
    }
    return TaskQuality(series.task, len(series.scores), final, rho, ratio, margin, tau, checks)


@dataclass(frozen=True)
class RunSeries:
    """One training run's scores on one task: an experiment has one per variant and seed."""

    variant: str
    seed: int
    steps: tuple[float, ...]  # global step of each evaluated checkpoint, increasing
    scores: tuple[float, ...]
    stderr: tuple[float, ...] = ()  # per-score standard error, if known


def seed_noise(runs: Sequence[RunSeries]) -> tuple[float | None, int]:
    """Std of the final score across seeds, pooled over the variants that have several seeds
    (sum of squared deviations from each variant's mean over the sum of its degrees of freedom),
    and those degrees of freedom; (None, 0) when no variant has two seeds."""
    by_variant: dict[str, list[float]] = {}
    for r in runs:
        by_variant.setdefault(r.variant, []).append(float(r.scores[-1]))
    ss, df = 0.0, 0
    for finals in by_variant.values():
        if len(finals) > 1:
            mean = statistics.fmean(finals)
            ss += sum((x - mean) ** 2 for x in finals)
            df += len(finals) - 1
    return (math.sqrt(ss / df), df) if df else (None, 0)


def assess_runs(
    task: str,
    runs: Sequence[RunSeries],
    random: float,
    better: str = "higher",
    thresholds: Thresholds = Thresholds(),
    cross_task_tau: float | None = None,
) -> TaskQuality:
    """The four criteria for one task over an experiment's runs (variants x seeds):
    - monotonic: mean Spearman rho of score vs step over the runs with 3+ checkpoints (of the
      negated score when lower is better);
    - low noise: SNR of the mean final score over the seed noise pooled across variants (else,
      with one seed or seeds that all scored the same, the mean stderr of the final scores);
    - above random: (final - random) / noise, towards better;
    - consistent: Kendall tau of the variants' ordering (mean over seeds) between successive
      common checkpoints, else `cross_task_tau` (agreement with the other tasks, for experiments
      evaluated once per run, such as anneals)."""
    if not runs:
        raise ValueError(f"task {task!r} has no runs")
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    sign = 1.0 if better == "higher" else -1.0
    rhos = [monotonicity(r.steps, [sign * x for x in r.scores]) for r in runs if len(r.scores) >= 3]
    rho = statistics.fmean(rhos) if rhos else None
    noise, _ = seed_noise(runs)
    # Seeds that all scored the same (a coarse metric) measured its resolution, not its noise.
    noise = noise or None
    source = "seeds" if noise is not None else None
    if noise is None and all(r.stderr for r in runs):
        noise, source = statistics.fmean(float(r.stderr[-1]) for r in runs), "stderr"
    final = statistics.fmean(float(r.scores[-1]) for r in runs)
    ratio = snr(final, noise)
    margin = margin_sigmas(sign * final, sign * random, noise)
    common = sorted(set.intersection(*(set(r.steps) for r in runs)))
    curves: dict[str, list[float]] = {}
    for variant in dict.fromkeys(r.variant for r in runs):
        mine = [dict(zip(r.steps, r.scores, strict=True)) for r in runs if r.variant == variant]
        curves[variant] = [statistics.fmean(m[s] for m in mine) for s in common]
    tau = ranking_consistency(curves) if len(common) >= 2 else None
    if tau is None:
        tau = cross_task_tau
    checks = {
        "monotonic": None if rho is None else rho >= thresholds.spearman,
        "low_noise": None if ratio is None else ratio > thresholds.snr,
        "above_random": None if margin is None else margin > thresholds.margin_sigmas,
        "consistent": None if tau is None else tau >= thresholds.kendall,
    }
    return TaskQuality(task, max(len(r.scores) for r in runs), final, rho, ratio, margin, tau, checks, better, source)


def quality_table(rows: Sequence[TaskQuality], thresholds: Thresholds = Thresholds()) -> str:
    """A fixed-width table for the terminal; under each dropped task, which criteria failed (with
    the values) and which could not be measured."""

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else ("inf" if math.isinf(v) else format(v, fmt))

    def mark(v: bool | None) -> str:
        return "-" if v is None else "ok" if v else "FAIL"

    header = f"{'task':<22} {'n':>3} {'final':>7} {'spearman':>9} {'snr':>8} {'margin':>8} {'kendall':>8}  {'mono':>4} {'noise':>5} {'rand':>5} {'rank':>5}  keep"
    lines = [header, "-" * len(header)]
    for r in rows:
        c = r.checks
        lines.append(
            f"{r.task:<22} {r.points:>3} {r.final:>7.3f} {f(r.spearman, '.2f'):>9} {f(r.snr, '.1f'):>8} "
            f"{f(r.margin, '.1f'):>8} {f(r.kendall, '.2f'):>8}  {mark(c['monotonic']):>4} "
            f"{mark(c['low_noise']):>5} {mark(c['above_random']):>5} {mark(c['consistent']):>5}  "
            f"{'yes' if r.keep else 'no'}"
        )
        failed, unmeasured = r.why(thresholds)
        if not r.keep:
            lines.append("    dropped: " + ("; ".join(failed) if failed else "no criterion could be measured"))
        if unmeasured:
            lines.append("    not measured: " + "; ".join(unmeasured))
    return "\n".join(lines)


CRITERIA_HELP = """\
A task is kept when every criterion that could be measured passes:
  mono   monotonic: Spearman rho of score vs training step >= {t.spearman:g}
  noise  low noise: SNR = final score / noise > {t.snr:g} (noise: seed std, else the final score's stderr)
  rand   above random: final score - random > {t.margin_sigmas:g} x noise
  rank   consistent: Kendall tau of its ranking (anneal candidates, or models over steps) >= {t.kendall:g}"""


# --- reading a run from lineage ---------------------------------------------------------------


def run_series(lineage, run_id: str, metric: str = "acc_norm") -> dict[str, TaskSeries]:
    """Scores of every evaluate step of a run, in training order, as one series per task.

    The step of each eval is the cumulative number of optimizer steps of the stages trained so far
    (eval -> hf_model -> checkpoint in lineage)."""
    position, seen = 0, set()
    points: dict[str, list[tuple[float, float, float | None]]] = {}
    randoms: dict[str, float] = {}
    for _, e in lineage.labelled_outputs(run_id, "evaluate"):
        meta = e.meta
        ckpt = _checkpoint_of(lineage, e.fingerprint)
        if ckpt is None:
            continue  # not a trained stage (e.g. an imported model)
        if ckpt["fingerprint"] not in seen:
            seen.add(ckpt["fingerprint"])
            position += int(json.loads(ckpt["meta"]).get("steps") or 0)
        for task, values in meta.get("scores", {}).items():
            if metric in values and not math.isnan(values[metric]):
                points.setdefault(task, []).append((position, values[metric], values.get(f"{metric}_stderr")))
                randoms[task] = float(meta.get("random_accuracy") or 0.0)
    return {
        task: TaskSeries(
            task=task,
            steps=tuple(p[0] for p in pts),
            scores=tuple(p[1] for p in pts),
            stderr=tuple(p[2] for p in pts) if all(p[2] is not None for p in pts) else (),
            random=randoms[task],
        )
        for task, pts in sorted(points.items())
    }


def _checkpoint_of(lineage, eval_fp: str) -> dict[str, Any] | None:
    for parent in lineage.parents(eval_fp):
        if parent["kind"] == "hf_model":
            for grand in lineage.parents(parent["fingerprint"]):
                if grand["kind"] == "checkpoint" and grand["step"] == "pretrain":
                    return grand
    return None  # not a trained stage (an imported or post-trained model)


def anneal_consistency(lineage, metric: str = "acc_norm") -> dict[str, float]:
    """Kendall tau per task from the latest anneal experiment (evals/experiments.py): how each
    task orders the baseline and the candidates against the other tasks' consensus."""
    latest = lineage.experiments("anneal")
    if not latest:
        return {}
    by_task: dict[str, dict[str, float]] = {}
    for r in lineage.experiment_results(latest[0]["experiment"]):
        if r["metric"] in (metric, "bpb"):
            # Lower bits per byte is better: rank by its negation so every task ranks "higher is better".
            sign = -1.0 if r["better"] == "lower" else 1.0
            by_task.setdefault(r["task"], {})[r["variant"]] = sign * r["score"]
            by_task[r["task"]]["baseline"] = sign * r["baseline"]
    return candidate_consistency(by_task)


def main(argv: Sequence[str] | None = None, prog: str = "python -m evals.quality") -> int:
    from pipeline.lineage import Lineage
    from pipeline.workspace import resolve_workspace

    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=CRITERIA_HELP.format(t=Thresholds()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "workspace",
        nargs="?",
        default="workspace",
        help="workspace folder holding lineage.duckdb (default: workspace, relative to "
        "$SMOLLM3_HOME or else the project root)",
    )
    p.add_argument("--run", help="flow run id (default: the latest smollm3 run)")
    p.add_argument(
        "--metric", default="acc_norm", help="score to judge: acc_norm (default, the cloze tasks), acc or exact_match"
    )
    args = p.parse_args(argv)
    lineage = Lineage(resolve_workspace(args.workspace) / "lineage.duckdb", read_only=True)  # a view: writes nothing
    with lineage.reading():  # dozens of small reads on one connection
        run = args.run
        if run is None:
            run = lineage.latest_run("smollm3")
            if run is None:
                print(f"no smollm3 run in {lineage.path}")
                return 1
        series = run_series(lineage, run, args.metric)
        taus = anneal_consistency(lineage, args.metric)
    if not series:
        print(f"run {run} has no {args.metric} scores of trained stages in {lineage.path}")
        return 1
    print(f"eval-task quality of run {run} ({args.metric})")
    print(quality_table([assess(s, kendall_tau=taus.get(t)) for t, s in series.items()]))
    print(CRITERIA_HELP.format(t=Thresholds()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
