"""Context parallelism's pieces below the trainer (model/context_parallel.py, model/layout.py,
model/attention.py, model/model.py): the load-balanced shards, the layout and its checks, the
masks of each CP rank, which must be exactly CP 1's mask restricted to the rank's query rows and
the gathered key order, for the dense (SDPA) and the FlexAttention backends (no processes); and
the model at CP 2 and CP 4 over gloo (spawned ranks) giving every parameter CP 1's gradient at
each of 8 AdamW steps. The trainer runs CP over gloo in tests/trainers/test_context_parallel.py
(losses, gradient norms, weights, HSDP with CP, resume, reshard)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from model.attention import build_attention_mask
from model.config import ModelConfig
from model.context_parallel import ContextParallel, gathered_index, local_index
from model.layout import check_context_parallel, plan_layout
from model.model import SmolLM3
from tests.model.test_attention import packed_doc_ids


def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i():
    assert local_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    order = gathered_index(16, 4)
    assert sorted(order.tolist()) == list(range(16))  # every token once
    # Causal work is even: every rank's queries see the same number of keys.
    seen = [int((local_index(64, 4, r)[:, None] >= torch.arange(64)[None]).sum()) for r in range(4)]
    assert len(set(seen)) == 1, seen


def test_layout_and_checks_name_cp():
    layout = plan_layout(96, 8, tp=2, hsdp=True, cp=4)
    assert (layout.dp, layout.replicate, layout.shard, layout.fsdp) == (12, 12, 1, 4)
    assert layout.describe() == "HSDP 12 x 1 x CP 4 x TP 2 (96 ranks)"
    assert layout.dp_rank(7) == 0 and layout.dp_rank(8) == 1
    with pytest.raises(ValueError, match="cp 8 x tp 2 must divide the processes per node"):
        plan_layout(32, 8, tp=2, cp=8)
    with pytest.raises(ValueError, match="cp 4 needs seq_len divisible by 2 x cp = 8"):
        check_context_parallel(4, 1, 36)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_rank_attends_with_the_cp1_mask_rows(cp):
    B, T, nh, nkv, hd = 2, 48, 4, 2, 8  # T / cp is no multiple of the flex block: padding is exercised
    doc_ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 23, [0] * 30 + [1] * 3 + [2] * 15])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, nh, T, hd, generator=gen)
    k, v = (torch.randn(B, nkv, T, hd, generator=gen) for _ in range(2))
    full = build_attention_mask(doc_ids, "sdpa").dense  # (B, 1, T, T), CP 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    for rank in range(cp):
        context = ContextParallel(None, cp, rank)
        q_at, kv_at = context.local_index(T, q.device), context.gathered_index(T, q.device)
        dense = build_attention_mask(doc_ids, "sdpa", context)
        assert torch.equal(dense.dense, full[:, :, q_at][:, :, :, kv_at])
        flex = build_attention_mask(doc_ids, "flex", context)
        qs = F.pad(q[:, :, q_at], (0, 0, 0, flex.flex_pad))
        ks, vs = (F.pad(t[:, :, kv_at], (0, 0, 0, flex.kv_pad)) for t in (k, v))
        from torch.nn.attention.flex_attention import flex_attention

        with warnings.catch_warnings():  # uncompiled on CPU on purpose (model/attention.py)
            warnings.simplefilter("ignore")
            y = flex_attention(qs, ks, vs, block_mask=flex.block_mask, enable_gqa=True)[:, :, : q_at.numel()]
        torch.testing.assert_close(y, ref[:, :, q_at], atol=1e-5, rtol=1e-5)


# ---- every parameter's gradient under CP, spawned ranks over gloo ----------------------------------

CP_STEPS, CP_SEQ = 8, 64  # 64 = 8 chunks of 8 tokens at CP 4


def _cp_case(cfg: ModelConfig):
    """The initial weights and CP_STEPS batches of 2 rows x CP_SEQ tokens, about 6 documents a row."""
    torch.manual_seed(0)
    state = SmolLM3(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for step in range(CP_STEPS):
        ids = torch.randint(0, cfg.vocab_size, (2, CP_SEQ), generator=gen)
        batches.append((ids, packed_doc_ids(2, CP_SEQ, seed=step), ids.roll(-1, 1)))
    return state, batches


def _cp_train(model, batches, reduce_grads=None):
    """(losses, per-step gradients by name) of one AdamW step per batch; `reduce_grads` runs
    between backward and the update (under CP: the CP group's mean, what FSDP2's reduce-scatter
    over the DP x CP ranks computes in the trainer)."""
    from model.optim import build_optimizer
    from model.spec import OptimizerConfig

    opt = build_optimizer(model, OptimizerConfig(lr=3e-3))
    losses, grads = [], []
    for ids, docs, labels in batches:
        loss = model(ids, docs, labels).loss
        loss.backward()
        if reduce_grads is not None:
            reduce_grads(model)
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _cp_worker(rank: int, world: int, init_file: str, cfg_dict: dict, out: str) -> None:
    """One rank of a CP group of `world` over gloo: the whole batch in, this rank's load-balanced
    share trained (model/model.py slices it), the gradients averaged over the group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig.from_dict(cfg_dict)
        state, batches = _cp_case(cfg)
        model = SmolLM3(cfg)
        model.load_state_dict(state)
        model.context_parallel = ContextParallel.of(dist.group.WORLD)

        def group_mean(m) -> None:
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world

        run = _cp_train(model, batches, group_mean)
        torch.save(run, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawned ranks: 2 + 4 processes
@pytest.mark.parametrize("cp", [2, 4])
def test_every_parameter_gets_the_cp1_gradient_over_8_steps(tiny_cfg, tmp_path, cp):
    """CP 2 and CP 4 (all-gather-KV attention with the dense mask, several documents per row)
    against one plain rank, 8 AdamW steps: every CP rank's loss within 1e-5 relative of CP 1's and,
    after the group mean, every parameter's gradient within 1e-4 relative (by its norm) at every step."""
    import torch.multiprocessing as mp

    out = tmp_path / "cp.pt"
    mp.start_processes(
        _cp_worker, args=(cp, str(tmp_path / "init"), tiny_cfg.to_dict(), str(out)), nprocs=cp, start_method="spawn"
    )
    state, batches = _cp_case(tiny_cfg)
    plain = SmolLM3(tiny_cfg)
    plain.load_state_dict(state)
    ref_losses, ref_grads = _cp_train(plain, batches)
    for rank in range(cp):
        losses, grads = torch.load(f"{out}.{rank}")
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0), (rank, losses, ref_losses)
        for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
            assert got.keys() == want.keys()
            for name in want:
                rel = float((got[name] - want[name]).norm() / want[name].norm())
                assert rel <= 1e-4, (rank, step, name, rel)
