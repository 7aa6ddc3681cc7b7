"""evals/report.py: the eval table, one metric per task with its stderr, the random baseline,
and the items each model was scored on per row (eval artifacts as the evaluate step records them,
old and new)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.report import eval_rows, eval_table_markdown, eval_table_text, moves
from pipeline.artifact import Artifact


def _eval(root: Path, name: str, scores: dict, **meta) -> Artifact:
    folder = root / "evaluate" / name
    folder.mkdir(parents=True)
    results = meta.pop("results", None)
    if results:
        (folder / "lm_eval_results.json").write_text(json.dumps(results))
    return Artifact(
        kind="eval",
        uri=str(folder),
        fingerprint=name * 8,
        meta={"stage": name, "scores": scores, "random_accuracy": 0.25, **meta},
    )


def eval_artifacts(root: Path) -> list[tuple[str, Artifact]]:
    cloze = {
        "prose_cloze": {"acc": 0.29, "acc_stderr": 0.045, "acc_norm": 0.31, "acc_norm_stderr": 0.046},
        "arithmetic_cloze": {"acc": 0.41, "acc_stderr": 0.049, "acc_norm": 0.2, "acc_norm_stderr": 0.04},
    }
    return [
        (
            "stage1",
            _eval(
                root,
                "stage1",
                cloze,
                items={"prose_cloze": 100, "arithmetic_cloze": 100},
                random_baseline={"prose_cloze": 0.25, "arithmetic_cloze": 0.2525},
            ),
        ),
        # Recorded before items and baselines were: items from lm-eval's file, 1 / choices.
        (
            "stage2",
            _eval(
                root,
                "stage2",
                cloze,
                results={
                    "n-samples": {
                        "prose_cloze": {"original": 100, "effective": 100},
                        "arithmetic_cloze": {"original": 100, "effective": 100},
                    }
                },
            ),
        ),
        (
            "sft",
            _eval(
                root,
                "sft",
                {
                    "prose_cloze": {"acc": 0.35, "acc_stderr": 0.11, "acc_norm": 0.4, "acc_norm_stderr": 0.112},
                    "arithmetic_exact": {"exact_match": 0.1, "exact_match_stderr": 0.043},
                    # think mode: the evaluation adds its mean think length and closed share
                    "arithmetic_exact_think": {
                        "exact_match": 0.3,
                        "exact_match_stderr": 0.065,
                        "think_tokens": 41.5,
                        "think_closed": 0.9,
                    },
                },
                items={"prose_cloze": 20, "arithmetic_exact": 50, "arithmetic_exact_think": 50},
                random_baseline={"prose_cloze": 0.25, "arithmetic_exact": 0.0, "arithmetic_exact_think": 0.0},
            ),
        ),
    ]


def test_eval_table_one_metric_per_task_with_stderr_random_and_items_per_row(tmp_path):
    rows = eval_rows(eval_artifacts(tmp_path))
    text = eval_table_text(rows)
    lines = text.splitlines()
    # no-think then think mode of the generation task, side by side
    header = ["model", "arithmetic_cloze", "prose_cloze", "arithmetic_exact", "arithmetic_exact_think", "items"]
    assert lines[0].split() == header
    assert lines[1].split() == ["metric", "acc", "acc_norm", "exact_match", "exact_match"]
    assert lines[2].split() == ["random", "0.253", "0.250", "0.000", "0.000"]
    assert lines[3] == ""
    # the items each model was scored on are its row's: one count, or n= per cell where they differ
    assert lines[4].split() == ["stage1", "0.410±0.049", "0.310±0.046", "-", "-", "100"]
    assert lines[5].split() == ["stage2", "0.410±0.049", "0.310±0.046", "-", "-", "100"]  # same items, 1/choices
    # 20 and 50 items: each cell says so; the stderr says 0.40 is within noise of 0.31.
    assert "0.300±0.065 (n=50, think 41.5 tok, 90% closed)" in lines[6]
    assert lines[6].split()[:6] == ["sft", "-", "0.400±0.112", "(n=20)", "0.100±0.043", "(n=50)"]
    assert lines[6].split()[-2:] == ["per", "task"]
    assert "two stderr" in text and "items" not in "".join(lines[1:3])  # no items row to contradict a row
    markdown = eval_table_markdown(rows)
    assert "| *metric* | *acc* | *acc_norm* | *exact_match* | *exact_match* |  |" in markdown
    sft = "| sft | - | 0.400±0.112 (n=20) | 0.100±0.043 (n=50) | 0.300±0.065 (n=50, think 41.5 tok, 90% closed) |"
    assert sft + " per task |" in markdown
    assert "| stage1 | 0.410±0.049 | 0.310±0.046 | - | - | 100 |" in markdown
    assert "arithmetic_exact_think: the same in think mode" in markdown
    assert eval_table_text([]) == "no evaluations in this run"


def test_passkeys_past_the_trained_length_are_the_last_passkey_columns_with_a_row_per_rope(tmp_path):
    """The last stage read at 2x its length (`eval.beyond_factor`, tasks/evaluate.py): its plain-RoPE
    and YaRN evaluations are two rows, `<stage>-x2` and `<stage>-x2-yarn`, scored only on
    `passkey_beyond_<words>`, a column after the passkeys within the trained length (shorter
    first) and before generation; the stage's own row has no cell there, theirs none elsewhere."""

    def passkey(acc, se):
        return {"acc": acc, "acc_stderr": se}

    long2 = {
        "passkey_1000": passkey(0.6, 0.1),
        "passkey_100": passkey(0.9, 0.05),
        "arithmetic_exact": {"exact_match": 0.1, "exact_match_stderr": 0.04},
    }
    evals = [
        ("long2", _eval(tmp_path, "long2", long2, items={t: 20 for t in long2}, random_baseline={"passkey_1000": 0.1, "passkey_100": 0.1, "arithmetic_exact": 0.0})),
        ("long2-x2", _eval(tmp_path, "long2-x2", {"passkey_beyond_1300": passkey(0.1, 0.07)}, items={"passkey_beyond_1300": 20}, random_baseline={"passkey_beyond_1300": 0.1}, beyond={"factor": 2.0, "yarn": False})),
        ("long2-x2-yarn", _eval(tmp_path, "long2-x2-yarn", {"passkey_beyond_1300": passkey(0.45, 0.11)}, items={"passkey_beyond_1300": 20}, random_baseline={"passkey_beyond_1300": 0.1}, beyond={"factor": 2.0, "yarn": True})),
    ]  # fmt: skip
    lines = eval_table_text(eval_rows(evals)).splitlines()
    assert lines[0].split() == [
        "model",
        "passkey_100",
        "passkey_1000",
        "passkey_beyond_1300",
        "arithmetic_exact",
        "items",
    ]
    assert lines[4].split() == ["long2", "0.900±0.050", "0.600±0.100", "-", "0.100±0.040", "20"]
    assert lines[5].split() == ["long2-x2", "-", "-", "0.100±0.070", "-", "20"]
    assert lines[6].split() == ["long2-x2-yarn", "-", "-", "0.450±0.110", "-", "20"]
    markdown = eval_table_markdown(eval_rows(evals))
    assert "| long2-x2 | - | - | 0.100±0.070 | - | 20 |" in markdown
    assert "| long2-x2-yarn | - | - | 0.450±0.110 | - | 20 |" in markdown


def _scored(label: str, scores: dict[str, tuple[float, float]]) -> list[dict]:
    metric = {"arithmetic_exact": "exact_match", "prose_cloze": "acc_norm", "arithmetic_cloze": "acc"}
    return [
        {"model": label, "task": t, "metric": metric[t], "score": s, "stderr": se, "items": 50, "random": 0.0}
        for t, (s, se) in scores.items()
    ]


def test_a_post_training_step_that_moved_no_score_beyond_noise_is_flagged():
    rows = (
        _scored("base", {"arithmetic_exact": (0.0, 0.0), "prose_cloze": (0.25, 0.1), "arithmetic_cloze": (0.3, 0.1)})
        # sft: exact match 0 -> 0.30 (stderr 0.065): 4.6 combined stderr, more than noise
        + _scored("sft", {"arithmetic_exact": (0.3, 0.065), "prose_cloze": (0.3, 0.1), "arithmetic_cloze": (0.3, 0.1)})
        # apo: every change under two combined stderr (0.34 - 0.30 = 0.04 of 0.094; 0.15 of 0.141)
        + _scored(
            "apo", {"arithmetic_exact": (0.34, 0.067), "prose_cloze": (0.45, 0.1), "arithmetic_cloze": (0.3, 0.1)}
        )
        # grpo: one of three tasks moved is enough; a parent missing a task compares the others
        + _scored("grpo", {"arithmetic_exact": (0.6, 0.069), "prose_cloze": (0.45, 0.1)})
    )
    parents = [("sft", "base"), ("apo", "sft"), ("grpo", "apo")]
    got = {m["model"]: m for m in moves(rows, parents)}
    assert {k: m["moved"] for k, m in got.items()} == {"sft": True, "apo": False, "grpo": True}
    sft = {c["task"]: c for c in got["sft"]["changes"]}
    assert sft["arithmetic_exact"]["z"] == pytest.approx(0.3 / 0.065)
    assert sft["prose_cloze"]["z"] == pytest.approx(0.05 / (2 * 0.01) ** 0.5)
    assert [c["task"] for c in got["grpo"]["changes"]] == ["prose_cloze", "arithmetic_exact"]
    # a score certain on both sides (stderr 0) that moved is a move; one that did not is none
    exact = _scored("a", {"arithmetic_exact": (0.0, 0.0)}) + _scored("b", {"arithmetic_exact": (1.0, 0.0)})
    assert moves(exact, [("b", "a")])[0]["changes"][0]["z"] == float("inf")
    assert moves(exact + _scored("c", {"arithmetic_exact": (0.0, 0.0)}), [("c", "a")])[0]["moved"] is False

    text = eval_table_text(rows, parents)
    assert "apo vs sft: NO CHANGE BEYOND NOISE on any task (largest: prose_cloze +0.150, +1.1 se)" in text
    assert "sft vs base: arithmetic_exact +0.300 (+4.6 se)" in text
    assert "grpo vs apo: arithmetic_exact +0.260 (+2.7 se)" in text
    markdown = eval_table_markdown(rows, parents)
    assert "\n\n- sft vs base: arithmetic_exact +0.300 (+4.6 se)\n- apo vs sft: NO CHANGE BEYOND NOISE" in markdown
    # without parents (a run without post-training, or before its report) the table is as before
    assert "NO CHANGE" not in eval_table_text(rows) and "started from" not in eval_table_markdown(rows)
    assert "reasoning stages" not in text  # none compared here


def test_the_reasoning_stage_is_compared_with_the_model_it_started_from_when_that_was_scored():
    """`posttrain.eval.before_reasoning`: base (the reasoning export) against before-reasoning,
    on the same items: think-mode exact match 0 -> 0.32 is a move; the header says which pair
    stands for the reasoning stages."""
    rows = _scored("before-reasoning", {"arithmetic_exact": (0.0, 0.0), "prose_cloze": (0.3, 0.1)}) + _scored(
        "base", {"arithmetic_exact": (0.32, 0.047), "prose_cloze": (0.3, 0.1)}
    )
    text = eval_table_text(rows, [("base", "before-reasoning")])
    assert "(and the reasoning stages: base vs before-reasoning) started from" in text
    assert "base vs before-reasoning: arithmetic_exact +0.320 (+6.8 se)" in text
    flat = _scored("before-reasoning", {"arithmetic_exact": (0.0, 0.0)}) + _scored(
        "base", {"arithmetic_exact": (0.0, 0.0)}
    )
    assert "base vs before-reasoning: NO CHANGE BEYOND NOISE" in eval_table_text(flat, [("base", "before-reasoning")])


def test_always_giving_the_most_common_answer_is_flagged_as_no_change_beyond_the_constant_guess(tmp_path):
    """Exact match's random baseline is the constant guess (the most common answer's share of the
    items, evals/harness.py `random_baselines`): a model that answers that number to every
    question beats a model that is never right by more than two combined stderr, and is still
    flagged, because it does not beat the guess; a model right on 40% is a move."""
    import re

    from lm_eval.api.metrics import mean_stderr

    from evals.benchmarks.arithmetic_exact import ANSWER_PATTERN
    from evals.harness import random_baselines

    answers = [str(6 if i % 10 == 0 else 20 + i) for i in range(100)]  # 6 is the answer of 10 items
    task_dir = tmp_path / "suite" / "tasks"
    task_dir.mkdir(parents=True)
    items = [{"problem": f"q{i}", "answer": a, "prompt": f"q{i}"} for i, a in enumerate(answers)]
    (task_dir / "arithmetic_exact.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    suite = Artifact(kind="eval", uri=str(tmp_path / "suite"), fingerprint="s" * 64, meta={"task_dir": str(task_dir)})
    random = random_baselines(suite, ["arithmetic_exact"], None)
    assert random == {"arithmetic_exact": 0.1}

    def evaluation(label: str, replies: list[str]) -> tuple[str, Artifact]:
        hits = [float(re.search(ANSWER_PATTERN, r)[1] == a) for r, a in zip(replies, answers, strict=True)]
        scores = {"arithmetic_exact": {"exact_match": sum(hits) / len(hits), "exact_match_stderr": mean_stderr(hits)}}
        meta = {"items": {"arithmetic_exact": 100}, "random_baseline": random}
        return label, _eval(tmp_path, label, scores, **meta)

    labelled = [
        evaluation("base", ["Answer: -1"] * 100),  # never right
        evaluation("sft", ["Answer: 6"] * 100),  # the most common answer, whatever the question
        evaluation("grpo", [f"Answer: {a if i % 5 < 2 else -1}" for i, a in enumerate(answers)]),  # 40% right
    ]
    rows = eval_rows(labelled)
    sft = next(r for r in rows if r["model"] == "sft")
    assert (sft["score"], sft["random"]) == (pytest.approx(0.1), 0.1)
    got = {m["model"]: m for m in moves(rows, [("sft", "base"), ("grpo", "sft")])}
    change = got["sft"]["changes"][0]
    assert change["z"] > 3 and change["beyond_guess"] is False  # beyond noise of the parent, not of the guess
    assert got["sft"]["moved"] is False and got["grpo"]["moved"] is True
    text = eval_table_text(rows, [("sft", "base"), ("grpo", "sft")])
    assert (
        "sft vs base: NO CHANGE BEYOND NOISE on any task (largest: arithmetic_exact +0.100, +3.3 se, within noise of the constant guess 0.100)"
        in text
    )
    assert "grpo vs sft: arithmetic_exact +0.300" in text
    assert "random" in text and "0.100" in text.splitlines()[2]  # the table's random row: the constant guess
