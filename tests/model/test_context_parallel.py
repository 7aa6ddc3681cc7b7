"""Context parallelism's pieces without processes (model/context_parallel.py, model/layout.py,
model/attention.py): the load-balanced shards, the layout and its checks, and the masks of each
CP rank, which must be exactly CP 1's mask restricted to the rank's query rows and the gathered key
order, for the dense (SDPA) and the FlexAttention backends. The trainer runs CP over gloo in
tests/trainers/test_context_parallel.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from model.attention import build_attention_mask
from model.context_parallel import ContextParallel, gathered_index, local_index
from model.layout import check_context_parallel, plan_layout


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
