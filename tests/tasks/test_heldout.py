"""tasks/heldout.py: held-out token sets with the bytes of text each token covers, and the
evaluation of every kept checkpoint of a stage trained by the real trainer (the scores
themselves: tests/evals/test_heldout_loss.py)."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.artifact import Artifact
from tasks.heldout import HeldoutEvalSpec, HeldoutSpec, heldout_eval, heldout_tokens

REPO = Path(__file__).resolve().parents[2]
# the texts and the tokenizer trained on them, as the library's tests use them
from tests.evals.test_heldout_loss import TEXTS, tokenizer_dir  # noqa: E402, F401


def _corpus(root: Path, name: str, texts: list[str]) -> Artifact:
    folder = root / name / "heldout"
    folder.mkdir(parents=True)
    with gzip.open(folder / "00000.jsonl.gz", "wt", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"id": f"{name}-{i}", "text": t, "metadata": {}}) + "\n")
    return Artifact(kind="corpus", uri=str(root / name), fingerprint=name * 16, meta={"source": name})


def test_heldout_set_records_tokens_and_bytes_of_text(tokenizer_dir, tmp_path):  # noqa: F811
    tok = Artifact(
        kind="tokenizer",
        uri=str(tokenizer_dir),
        fingerprint="t" * 64,
        meta={
            "tokenizer_json": str(tokenizer_dir / "tokenizer.json"),
            "vocab_size": 320,
            "eos_token": "<|endoftext|>",
            "eos_id": 0,
        },
    )
    corpus = _corpus(tmp_path, "prose", TEXTS)
    out = tmp_path / "out"
    out.mkdir()
    meta = heldout_tokens(
        HeldoutSpec(domain="prose", sources=("prose",), max_tokens=10_000),
        tokenizer=tok,
        corpora=[corpus],
        out=out,
        log=lambda _: None,
    )
    ids, nbytes = np.load(meta["file"]), np.load(meta["bytes_file"])
    assert len(ids) == len(nbytes) == meta["tokens"]
    assert meta["bytes"] == sum(len(t.encode("utf-8")) for t in TEXTS)  # every document whole
    assert (ids == 0).sum() == len(TEXTS) and nbytes[ids == 0].sum() == 0  # EOS after each, no text


@pytest.fixture(scope="module")
def trained_stage(tmp_path_factory) -> Artifact:
    """A 4-step stage of the real trainer keeping a checkpoint every 2 steps."""
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("stage")
    plan = write_two_source_plan(root / "shards", seq_len=16, vocab_size=128)
    out = root / "pretrain"
    spec = {
        "mixture_plan": str(plan),
        "out_dir": str(out),
        "steps": 4,
        "global_batch": 4,
        "micro_batch": 4,
        "model_overrides": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 2,
            "num_heads": 2,
            "num_kv_heads": 1,
        },
        "optimizer": {"lr": 1e-2},
        "checkpoint_interval": 2,
        "keep_last": 3,
        "num_threads": 1,
        "peak_flops": 1e10,
    }
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(spec))
    subprocess.run(
        [sys.executable, "-m", "trainers.pretrain", str(out / "spec.json")],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    final = out / "checkpoints" / "step_00000004"
    return Artifact(
        kind="checkpoint", uri=str(out), fingerprint="c" * 64, meta={"stage": "stage1", "checkpoint": str(final)}
    )


@pytest.mark.slow
def test_every_kept_checkpoint_is_scored_in_step_order(trained_stage, tmp_path):
    rng = np.random.default_rng(0)
    held = tmp_path / "held"
    held.mkdir()
    tokens = rng.integers(1, 128, 16 * 6 + 1)
    tokens[::9] = 0
    np.save(held / "tokens.npy", tokens)
    np.save(held / "bytes.npy", np.where(tokens == 0, 0, 3).astype(np.int32))
    heldout = Artifact(
        kind="shards",
        uri=str(held),
        fingerprint="h" * 64,
        meta={"domain": "prose", "eos_id": 0, "file": str(held / "tokens.npy"), "bytes_file": str(held / "bytes.npy")},
    )
    every = heldout_eval(
        HeldoutEvalSpec(every_checkpoint=True),
        checkpoint=trained_stage,
        heldout=[heldout],
        out=tmp_path,
        log=lambda _: None,
    )
    assert [p["step"] for p in every["points"]] == [2, 4]
    assert [p["global_step"] for p in every["points"]] == [2, 4]
    last = heldout_eval(
        HeldoutEvalSpec(), checkpoint=trained_stage, heldout=[heldout], out=tmp_path, log=lambda _: None
    )
    assert [p["step"] for p in last["points"]] == [4]
    assert every["scores"] == last["scores"] == every["points"][-1]["scores"]
    first, final = (p["scores"]["heldout_prose"]["bpb"] for p in every["points"])
    assert final != first  # two different models
    assert every["random"]["heldout_prose"]["bpb"] == pytest.approx(math.log2(128) / 3)
