"""evals/experiments.py: variants from the command line, the two-sample interval against scipy,
and a whole comparison on constructed run scores (which tasks are trusted and why, the verdicts,
the report, the chart, the rows for DuckDB), including the one-seed case."""

from __future__ import annotations

import json
import statistics

import pytest

from evals.experiments import (
    AblationConfig,
    ExperimentSpec,
    RunRef,
    TrustConfig,
    Variant,
    difference,
    parse_variant,
    split_top_level,
)
from pipeline.artifact import Artifact
from tasks.compare import compare

CRITERIA = ("monotonic", "low_noise", "above_random", "consistent")


def test_variants_parse_from_the_command_line():
    v = parse_variant("lr_low:training.optimizer.lr=0.001")
    assert v == Variant(name="lr_low", overrides=("training.optimizer.lr=0.001",))
    v = parse_variant("wide:training.model_overrides={hidden_size: 512, num_heads: 8},seed=3")
    assert v.overrides == ("training.model_overrides={hidden_size: 512, num_heads: 8}", "seed=3")
    assert split_top_level("a=[1, 2],b='x,y',c=3") == ["a=[1, 2]", "b='x,y'", "c=3"]
    for bad, match in [
        ("nocolon", "NAME:key=value"),
        ("baseline:seed=1", "not 'baseline'"),
        ("x:", "changes nothing"),
        ("x:seed", "is not key=value"),
        ("Bad:seed=1", "lowercase"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)
    with pytest.raises(ValueError, match="repeated: a"):
        AblationConfig(variants=(Variant(name="a"), Variant(name="a")))
    assert AblationConfig(variants=(Variant(name="a"), Variant(name="b"))).label == "a+b"


def test_difference_is_the_pooled_two_sample_t_test():
    from scipy.stats import ttest_ind

    base, var = [2.10, 2.12, 2.09], [2.00, 2.03]
    d = difference(base, var, 0.95)
    ref = ttest_ind(var, base, equal_var=True)
    assert d["delta"] == pytest.approx(sum(var) / 2 - sum(base) / 3)
    assert d["df"] == 3 and d["p_value"] == pytest.approx(ref.pvalue)
    ci = ref.confidence_interval(0.95)
    assert (d["ci_low"], d["ci_high"]) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert d["significant"] is True
    # Noise only where seeds repeat: one seed each leaves it unknown, never "significant".
    one = difference([2.1], [2.0], 0.95)
    assert one["seed_std"] is None and one["significant"] is None and one["ci_low"] is None
    # An anneal: baseline replicas give the noise for a single-run candidate.
    anneal = difference([2.10, 2.14], [2.11], 0.95)
    assert anneal["df"] == 1 and anneal["significant"] is False


def _heldout(run: str, steps, values, *, task="heldout_prose", se=0.002, random=3.5) -> Artifact:
    points = [
        {"step": s, "global_step": s, "scores": {task: {"bpb": v, "bpb_stderr": se, "loss": v, "loss_stderr": se}}}
        for s, v in zip(steps, values, strict=True)
    ]
    return Artifact(
        kind="eval",
        uri=f"/x/{run}",
        fingerprint=(run * 64)[:64],
        meta={"points": points, "scores": points[-1]["scores"], "random": {task: {"bpb": random}}},
    )


def _cloze(run: str, acc: float) -> Artifact:
    return Artifact(
        kind="eval",
        uri=f"/y/{run}",
        fingerprint=(run * 64)[::-1][:64],
        meta={"scores": {"prose_cloze": {"acc_norm": acc, "acc_norm_stderr": 0.04}}, "random_accuracy": 0.25},
    )


STEPS = (10, 20, 30, 40, 50)


def _experiment(seeds: int, offsets=(0.0, 0.004, -0.003)):
    """Baseline and `better` (0.1 bpb lower all along), each `seeds` runs with a little seed noise;
    prose_cloze stays at chance (0.25 +- a few items)."""
    runs, inputs = [], {}
    for variant, shift in (("baseline", 0.0), ("better", -0.1)):
        for k in range(seeds):
            label = f"{variant}-s{k}"
            curve = [3.0 - 0.15 * i + shift + offsets[k] for i in range(len(STEPS))]
            inputs[f"{label}.heldout"] = (_heldout(label, STEPS, curve),)
            inputs[f"{label}.lm"] = (_cloze(label, 0.25 + 0.01 * ((k + len(variant)) % 3 - 1)),)
            runs.append(RunRef(label=label, variant=variant, seed=k, lm_steps=(50,)))
    cfg = ExperimentSpec(
        kind="ablation",
        name="better",
        variants={"baseline": (), "better": ("x=1",)},
        runs=tuple(runs),
        trust=TrustConfig(require=CRITERIA),
    )
    return cfg, inputs


def test_a_real_difference_on_a_trusted_eval_is_significant_and_a_chance_eval_is_not_trusted(tmp_path):
    cfg, inputs = _experiment(seeds=3)
    meta = compare(cfg, out=tmp_path, log=lambda _: None, **inputs)
    assert meta["trusted"] == ["heldout_prose"]
    q = meta["quality"]
    assert q["heldout_prose"]["checks"] == dict.fromkeys(CRITERIA, True)
    assert q["heldout_prose"]["spearman"] == pytest.approx(1.0) and q["heldout_prose"]["noise"] == "seeds"
    # Cloze at chance, one point per run: flat, not above random, monotonicity unmeasurable.
    assert not q["prose_cloze"]["trusted"]
    assert "monotonicity unmeasured (fewer than 3 checkpoints)" in q["prose_cloze"]["why"]
    assert any(w.startswith("not above random") for w in q["prose_cloze"]["why"])
    rows = {r["task"]: r for r in meta["rows"]}
    bpb = rows["heldout_prose"]
    assert bpb["metric"] == "bpb" and bpb["better"] == "lower"
    assert bpb["delta"] == pytest.approx(-0.1) and bpb["df"] == 4
    offsets = (0.0, 0.004, -0.003)  # the same seed offsets in both groups: pooled std = their std
    assert bpb["seed_std"] == pytest.approx(statistics.stdev(offsets))
    assert bpb["ci_high"] < 0 and bpb["significant"] and bpb["improved"] and bpb["verdict"] == "better"
    assert bpb["trusted"] and bpb["why"] == ""
    assert rows["prose_cloze"]["verdict"].startswith("untrusted eval (")
    report = (tmp_path / "comparison.md").read_text()
    assert "| heldout_prose | bpb | 5 |" in report and "| better | heldout_prose | bpb (lower better) |" in report
    assert (tmp_path / "comparison.png").stat().st_size > 1000 and meta["chart"]
    points = json.loads((tmp_path / "points.json").read_text())
    assert len(points) == 6 * (len(STEPS) + 1)  # every run: 5 held-out points + 1 cloze score
    assert {p["variant"] for p in points} == {"baseline", "better"}


def test_one_seed_says_the_noise_is_unknown(tmp_path):
    cfg, inputs = _experiment(seeds=1)
    meta = compare(cfg, out=tmp_path, log=lambda _: None, **inputs)
    bpb = next(r for r in meta["rows"] if r["task"] == "heldout_prose")
    assert bpb["significant"] is None and bpb["improved"] is None and bpb["ci_low"] is None
    assert "noise unknown (one seed per variant)" in bpb["verdict"]
    # No seeds, so the eval's own stderr stands in for the noise criteria, and says so.
    assert meta["quality"]["heldout_prose"]["noise"] == "stderr"
    assert "no difference is called significant" in (tmp_path / "comparison.md").read_text()


def test_a_run_without_its_scores_is_refused(tmp_path):
    cfg, inputs = _experiment(seeds=2)
    del inputs["better-s1.heldout"]
    with pytest.raises(ValueError, match=r"no input\(s\) better-s1.heldout"):
        compare(cfg, out=tmp_path, log=lambda _: None, **inputs)
    with pytest.raises(ValueError, match="nothing to compare the baseline with"):
        ExperimentSpec(
            kind="ablation",
            name="x",
            variants={"baseline": ()},
            runs=(RunRef(label="a", variant="baseline"), RunRef(label="b", variant="baseline", seed=1)),
        )


def test_seeds_that_all_score_the_same_measure_resolution_not_noise():
    d = difference([0.25, 0.25], [0.30, 0.30], 0.95)  # accuracy on 20 items: steps of 0.05
    assert d["seed_std"] == 0 and d["significant"] is None and d["p_value"] is None
    from evals.quality import RunSeries, assess_runs

    runs = [RunSeries(v, k, (5,), (x,), (0.1,)) for v, x in (("a", 0.25), ("b", 0.30)) for k in (0, 1)]
    assert assess_runs("cloze", runs, random=0.25).noise_source == "stderr"
