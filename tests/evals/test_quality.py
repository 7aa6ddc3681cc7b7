"""Eval-task quality criteria on constructed score series: a monotone, low-noise task passes; a
noisy flat one fails; ranking consistency across steps and across anneal candidates."""

from __future__ import annotations

import math
import random

import pytest

from evals.quality import (
    TaskSeries,
    assess,
    bootstrap_std,
    candidate_consistency,
    kendall,
    monotonicity,
    quality_table,
    ranking_consistency,
)

STEPS = tuple(range(0, 1000, 100))


def test_monotone_low_noise_task_is_kept():
    scores = tuple(0.30 + 0.04 * i for i in range(10))  # 0.30 -> 0.66, steadily
    series = TaskSeries(
        "good",
        STEPS,
        scores,
        stderr=(0.01,) * 10,
        random=0.25,
        models={"a": scores, "b": tuple(s - 0.05 for s in scores)},
    )
    q = assess(series)
    assert q.spearman == pytest.approx(1.0)
    assert q.snr == pytest.approx(66.0) and q.margin == pytest.approx(41.0)
    assert q.kendall == pytest.approx(1.0)
    assert q.checks == {"monotonic": True, "low_noise": True, "above_random": True, "consistent": True}
    assert q.keep


def test_noisy_flat_task_is_dropped():
    rng = random.Random(0)
    scores = tuple(0.25 + rng.uniform(-0.03, 0.03) for _ in STEPS)  # random guessing, jittering
    seeds = ((0.22,), (0.27,), (0.25,))
    series = TaskSeries(
        "noisy", STEPS, scores, seed_scores=seeds, random=0.25, models={"a": scores, "b": tuple(reversed(scores))}
    )
    q = assess(series)
    assert abs(q.spearman) < 0.5 and not q.checks["monotonic"]
    assert q.snr < 20 and not q.checks["low_noise"]  # noise from the seed spread (std 0.025)
    assert not q.checks["above_random"]
    assert not q.keep
    table = quality_table(
        [
            assess(
                TaskSeries("good", STEPS, tuple(0.3 + 0.04 * i for i in range(10)), stderr=(0.01,) * 10, random=0.25)
            ),
            q,
        ]
    )
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["task", "n", "final"]
    assert lines[2].startswith("good") and lines[2].endswith("yes")
    # a kept task whose ranking could not be judged says so, without being dropped
    assert lines[3] == "    not measured: ranking consistency (needs an anneal comparison or several models)"
    noisy = lines.index(next(line for line in lines if line.startswith("noisy")))
    assert lines[noisy].endswith("no") and "FAIL" in lines[noisy]
    # why it is dropped: each failed criterion with its value and threshold
    why = lines[noisy + 1]
    assert why.startswith("    dropped: not monotonic: Spearman rho ")
    assert f"noisy: SNR {q.snr:.1f} <= 20" in why
    assert f"too close to random: margin {q.margin:.1f} sigma <= 3 sigma" in why
    assert "Kendall tau" in why and "< 0.5" in why


def test_a_task_with_nothing_measurable_says_so():
    q = assess(TaskSeries("short", (0, 100), (0.3, 0.4), random=0.25))  # 2 points, no stderr
    assert not q.keep
    failed, unmeasured = q.why()
    assert failed == []
    assert unmeasured[0] == "monotonicity (needs 3+ checkpoints, has 2)"
    lines = quality_table([q]).splitlines()
    assert lines[3] == "    dropped: no criterion could be measured"
    assert lines[4].startswith("    not measured: monotonicity (needs 3+ checkpoints, has 2); noise")


def test_statistics_edge_cases():
    assert monotonicity([1, 2, 3], [0.5, 0.5, 0.5]) == 0.0  # flat: no signal, not NaN
    assert monotonicity([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="3 steps but 2 scores"):
        monotonicity([1, 2, 3], [1, 2])
    assert kendall([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # Bootstrap std of a mean of 400 coin flips is close to the binomial sqrt(p(1-p)/n).
    items = [1.0] * 100 + [0.0] * 300
    assert bootstrap_std(items) == pytest.approx(math.sqrt(0.25 * 0.75 / 400), rel=0.1)
    assert ranking_consistency({"only": [1, 2]}) is None
    # Two models swapping places every step: rankings disagree.
    assert ranking_consistency({"a": [1, 3, 1, 3], "b": [2, 2, 2, 2]}) == pytest.approx(-1.0)


def test_candidate_ranking_consistency_against_the_other_tasks():
    by_task = {
        "t1": {"math": 0.6, "code": 0.5, "web": 0.4},
        "t2": {"math": 0.7, "code": 0.6, "web": 0.2},
        "t3": {"math": 0.1, "code": 0.3, "web": 0.5},  # ranks the candidates backwards
        "t4": {"math": 0.9, "code": 0.5, "web": 0.1},
    }
    taus = candidate_consistency(by_task)
    assert taus["t1"] == taus["t2"] == taus["t4"] == pytest.approx(1.0)
    assert taus["t3"] == pytest.approx(-1.0)


def test_statistics_equal_scipys():
    """Computed without scipy (a second to import); the same numbers, ties included."""
    from scipy.stats import kendalltau, rankdata, spearmanr

    from evals.quality import rankdata as ours

    rng = random.Random(7)
    for n in (2, 3, 5, 12, 40):
        for _ in range(20):
            a = [rng.choice((0.1, 0.2, 0.3, rng.random())) for _ in range(n)]  # with ties
            b = [rng.choice((0.5, rng.random())) for _ in range(n)]
            assert ours(a) == list(rankdata(a))
            if len(set(a)) > 1 and len(set(b)) > 1:
                assert monotonicity(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
                assert kendall(a, b) == pytest.approx(kendalltau(a, b).statistic, abs=1e-12)


def test_runs_of_an_experiment_lower_is_better_and_seed_noise():
    from evals.quality import RunSeries, assess_runs, seed_noise

    steps = (10, 20, 30, 40)

    def run(variant, seed, shift, jitter):
        return RunSeries(variant, seed, steps, tuple(3.0 - 0.2 * i + shift + jitter for i in range(4)))

    runs = [run("base", 0, 0.0, 0.01), run("base", 1, 0.0, -0.01), run("v", 0, -0.1, 0.0), run("v", 1, -0.1, 0.02)]
    noise, df = seed_noise(runs)
    assert df == 2 and noise == pytest.approx(math.sqrt((2 * 0.01**2 + 2 * 0.01**2) / 2))
    q = assess_runs("heldout_x", runs, random=3.6, better="lower")
    # Falling bits per byte is progress: monotonic with rho 1 (of the negated score).
    assert q.spearman == pytest.approx(1.0) and q.checks["monotonic"]
    assert q.margin == pytest.approx((3.6 - q.final) / noise) and q.checks["above_random"]
    assert q.kendall == pytest.approx(1.0) and q.noise_source == "seeds"
    assert q.trusted(("monotonic", "low_noise", "above_random", "consistent")) and q.reasons() == []
    # Read as higher-is-better the same numbers fall: not monotonic, and the reasons say so.
    wrong = assess_runs("heldout_x", runs, random=3.6, better="higher")
    assert wrong.spearman == pytest.approx(-1.0) and not wrong.keep
    assert wrong.reasons()[0].startswith("not monotonic (rho -1.00 < 0.5)")
    # Variants that swap places at every checkpoint are inconsistent.
    zigzag = [RunSeries("a", 0, steps, (1, 3, 1, 3)), RunSeries("b", 0, steps, (2, 2, 2, 2))]
    assert assess_runs("t", zigzag, random=0).kendall == pytest.approx(-1.0)
    # One checkpoint per run: monotonicity and ordering are unmeasurable; required, they block trust.
    single = [RunSeries("a", 0, (5,), (0.6,), (0.01,)), RunSeries("b", 0, (5,), (0.5,), (0.01,))]
    q1 = assess_runs("t", single, random=0.25)
    assert q1.spearman is None and q1.checks["monotonic"] is None and q1.noise_source == "stderr"
    assert q1.keep and not q1.trusted(("monotonic",))
    assert q1.reasons(require=("monotonic",)) == ["monotonicity unmeasured (fewer than 3 checkpoints)"]
    assert assess_runs("t", single, random=0.25, cross_task_tau=0.2).checks["consistent"] is False
