"""Context parallelism through the trainer on CPU over gloo (model/context_parallel.py), as real
torchrun launches on sequences of several packed documents each (intra-document masking on):

- CP 2, CP 4 and CP 2 x TP 2 (with selective checkpointing) train with the losses of CP 1 within
  1e-5 and the gradient norms within 1e-4 relative at each of 8 steps, and end at the same weights
  (fp32 summation order aside);
- HSDP with CP, the published long-context layout's composition (HSDP 12 x 1 x CP 4 x TP 2 in
  configs/smollm3-3b.yaml), as HSDP 2 x 1 x CP 2 over two torchrun "nodes" of two ranks: FSDP2
  over each node's CP pair, replicated across the nodes, trains like CP 1 as well;
- CP 2 resumed from its own checkpoint ends bit-identical to the uninterrupted run (the CP 2 run
  of the first bullet, trained once for both);
- a CP 2 checkpoint loads at another layout (one plain rank) and trains on like CP 2.

The load-balanced shards and the exact masks they need are tested without processes in
tests/model/test_context_parallel.py.
"""

from __future__ import annotations

import json

import pytest

from tests.trainers.test_parallel import _copy_checkpoint, _losses, _weights_close, run_two_nodes
from tests.trainers.test_pretrain import assert_same_weights, metrics, run_train, write_spec

SEQ = 64  # 2 x cp = 8 chunks of 8 tokens at CP 4; documents of 6 to 61 tokens: several per row
STEPS = dict(steps=8, global_batch=2, micro_batch=1, checkpoint_interval=4, keep_last=4)
STEPS["schedule"] = {"warmup_steps": 2, "decay_fraction": 0.25, "total_steps": 8}


def _grad_norms(out) -> list[float]:
    return [r["grad_norm"] for r in metrics(out)]


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


# One pytest-xdist worker runs this module, so its module fixtures (the CP 1 reference, the CP 2 run)
# are built once, not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("context-parallel")


@pytest.fixture(scope="module")
def cp1(tmp_path_factory):
    """The CP 1 reference (one plain rank), shared by the tests below."""
    from tests.model.conftest import write_two_source_plan

    root = tmp_path_factory.mktemp("cp1")
    plan = write_two_source_plan(root / "shards", seq_len=SEQ)
    out = root / "cp1"
    run_train(write_spec(root / "cp1.json", plan, out, **STEPS))
    return plan, out


@pytest.fixture(scope="module")
def cp2(cp1, tmp_path_factory):
    """The uninterrupted CP 2 run (two ranks, no activation checkpointing) and its stderr: the
    first case of `test_cp_trains_like_cp1` and the run `test_cp2_resumes...` resumes from."""
    plan, _ = cp1
    root = tmp_path_factory.mktemp("cp2")
    out = root / "cp2"
    proc = run_train(
        write_spec(root / "cp2.json", plan, out, cp=2, tp=1, activation_checkpointing="none", **STEPS), nproc=2
    )
    return out, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cp", "tp", "checkpointing", "layout"),
    [
        (2, 1, "none", "DP 1 x CP 2 (2 ranks)"),
        (4, 1, "none", "DP 1 x CP 4 (4 ranks)"),
        (2, 2, "selective", "DP 1 x CP 2 x TP 2 (4 ranks)"),  # composed with TP, recomputing the all-gather
    ],
)
def test_cp_trains_like_cp1(cp1, tmp_path, request, cp, tp, checkpointing, layout):
    plan, ref = cp1
    if (cp, tp, checkpointing) == (2, 1, "none"):
        out, stderr = request.getfixturevalue("cp2")  # this very run, shared with the resume test
    else:
        out = tmp_path / f"cp{cp}"
        spec = write_spec(
            tmp_path / "cp.json", plan, out, cp=cp, tp=tp, activation_checkpointing=checkpointing, **STEPS
        )
        stderr = run_train(spec, nproc=cp * tp).stderr
    assert f"world {cp * tp} ({layout}), accum 2" in stderr
    assert _close(_losses(out), _losses(ref), 1e-5), (_losses(out), _losses(ref))
    assert _close(_grad_norms(out), _grad_norms(ref), 1e-4), (_grad_norms(out), _grad_norms(ref))
    _weights_close(out, ref)


@pytest.mark.slow
def test_hsdp_with_cp_over_two_nodes_trains_like_cp1(cp1, tmp_path):
    """HSDP 2 x 1 x CP 2: each node's two ranks are one CP group and one FSDP shard group, the two
    nodes are DP replicas (one micro-batch each, no accumulation), as the long-context stages run
    at 12 nodes of TP 2 x CP 4."""
    plan, ref = cp1
    out = tmp_path / "hsdp_cp"
    spec = write_spec(tmp_path / "hsdp_cp.json", plan, out, cp=2, hsdp=True, **STEPS)
    outputs = run_two_nodes(spec)
    assert "world 4 (HSDP 2 x 1 x CP 2 (4 ranks)), accum 1" in outputs[0][1]
    assert _close(_losses(out), _losses(ref), 1e-5), (_losses(out), _losses(ref))
    assert _close(_grad_norms(out), _grad_norms(ref), 1e-4), (_grad_norms(out), _grad_norms(ref))
    _weights_close(out, ref)


@pytest.mark.slow
def test_cp2_resumes_bit_identically_and_loads_at_another_layout(cp1, cp2, tmp_path):
    plan, _ = cp1
    cp2, _ = cp2  # the uninterrupted CP 2 run, read only: the runs below train in folders of their own

    # The same layout, resumed from step 4 in a fresh folder: bit-identical to the uninterrupted run.
    again = tmp_path / "again"
    _copy_checkpoint(cp2, 4, again)
    resumed = run_train(write_spec(tmp_path / "again.json", plan, again, cp=2, **STEPS), nproc=2)
    assert "resumed from" in resumed.stderr and "step_00000004" in resumed.stderr
    assert _losses(again) == _losses(cp2)[4:]
    assert_same_weights(again, cp2, exact=True)

    # Another layout: the CP 2 checkpoint at step 4 continues on one plain rank.
    one = tmp_path / "one"
    _copy_checkpoint(cp2, 4, one)
    run_train(write_spec(tmp_path / "one.json", plan, one, **STEPS))
    assert json.loads((one / "result.json").read_text())["resumed_from"].endswith("step_00000004")
    assert _close(_losses(one), _losses(cp2)[4:], 1e-5)
    _weights_close(one, cp2)
