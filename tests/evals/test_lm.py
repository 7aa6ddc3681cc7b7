"""PrefixSharingLM: each shared context scored once, the same log-likelihoods as lm-eval's `hf`."""

from __future__ import annotations

import pytest
import torch

from evals.lm import _mask, _rows, score_requests, smollm3_view


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A random 2-layer SmolLM3 (NoPE on layer 2) exported with a small BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    root = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"The pass key is {i * 37 % 1000}. What is {i} + {i + 1}? It is {2 * i + 1}." for i in range(300)]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    model = SmolLM3(
        ModelConfig.tiny(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, no_rope_interval=2, max_seq_len=64
        )
    )
    model.init_weights(seed=1)
    return export_hf(model, root / "model", tokenizer_dir=root / "tok", eos_token_id=0)


def test_rows_share_prefixes_and_respect_the_window():
    ctx = list(range(1, 9))  # 8 tokens
    requests = [(ctx, [20, 21, 22]), (ctx, [30]), (ctx, [40, 41, 42, 43]), ([5, 6], [50, 51])]
    rows = _rows(requests, max_length=12, row_tokens=12)
    # Request 2 (3 new tokens) does not fit beside 0 and 1 in 12 tokens: a second row repeats
    # the context; request 3 shares nothing.
    assert [r.tokens for r in rows] == [ctx + [20, 21], ctx + [40, 41, 42], [5, 6, 50]]
    assert rows[0].positions == list(range(10)) and rows[0].subtree_ends() == [10] * 10
    # Request 1 feeds no token of its own: the context's last output predicts it.
    assert rows[0].scored == [(1, [7], [30]), (0, [7, 8, 9], [20, 21, 22])]
    # A tree: two continuations branch after a shared prefix; the second does not see the first.
    (row,) = _rows([([1, 2, 3], [4, 5]), ([1, 2, 3], [6, 7])], max_length=12, row_tokens=12)
    assert row.tokens == [1, 2, 3, 4, 6] and row.positions == [0, 1, 2, 3, 3]
    assert row.parent == [-1, 0, 1, 2, 2] and row.subtree_ends() == [5, 5, 5, 4, 5]
    assert row.scored == [(0, [2, 3], [4, 5]), (1, [2, 4], [6, 7])]
    assert _mask(torch.tensor([row.subtree_ends()]))[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    # Attention that grows with the row (span 1): sharing one token of four is not worth it.
    assert len(_rows([([1, 2, 3], [4, 5]), ([1, 7, 8], [9, 5])], 12, 12, span=1.0)) == 2
    assert len(_rows([([1, 2, 3], [4, 5]), ([1, 7, 8], [9, 5])], 12, 12)) == 1
    # Truncation as lm-eval's `hf` does it: the last max_length + 1 tokens, minus the last.
    (row,) = _rows([(list(range(1, 20)), [40, 41])], max_length=6, row_tokens=6)
    assert row.tokens == [15, 16, 17, 18, 19, 40] and row.scored == [(0, [4, 5], [40, 41])]
    with pytest.raises(ValueError, match="exceeds the model's 6-token window"):
        _rows([(ctx, list(range(7)))], max_length=6, row_tokens=6)


def test_scores_match_lm_eval_hf_request_by_request(tiny_export):
    """Many choices per context, contexts sharing a prefix, one-token and multi-token choices,
    greedy ones, a context past the window: log-likelihoods and greedy flags equal to the stock
    `hf` model's."""
    import lm_eval.models  # noqa: F401
    from lm_eval.models.huggingface import HFLM

    from evals.lm import PrefixSharingLM

    torch.set_num_threads(1)
    args = {"pretrained": str(tiny_export), "dtype": "float32", "device": "cpu", "batch_size": 3}
    stock, ours = HFLM(**args), PrefixSharingLM(**args, batch_tokens=100)
    assert ours.ours is not None and ours.max_length == 64
    # Contexts sharing prefixes across items too (like passkey filler), and one past the window.
    contexts = [
        "What is 3 + 4? It is",
        "The pass key is 81. " * 15 + "The pass key is",
        "What is 10 + 11?",
        "The",
        "What is 3 + 4? It is not",
        "The pass key is 81. " * 5 + "The pass key is 12. The pass key is",
    ]
    requests = []
    for context in contexts:
        for choice in [" 7", " 81", " 21 and more words here", " 12345", "?"]:
            requests.append(((context, choice), *ours._encode_pair(context, choice)))
        # The greedy next two tokens: is_greedy must come back True.
        ids = torch.tensor([requests[-1][1][-63:]])  # the window a 2-token continuation leaves
        with torch.no_grad():
            first = int(stock.model(ids).logits[0, -1].argmax())
            second = int(stock.model(torch.cat([ids, torch.tensor([[first]])], 1)).logits[0, -1].argmax())
        requests.append(((context, "greedy"), requests[-1][1], [first, second]))
    assert max(len(c) + len(k) for _, c, k in requests) > 65  # one context is truncated
    want = stock._loglikelihood_tokens(requests, disable_tqdm=True)
    # dense_limit 30: requests with longer windows take the `hf` path, the rest ours, in order.
    assert any(len(c) + len(k) > 31 for _, c, k in requests) and any(len(c) + len(k) <= 31 for _, c, k in requests)
    ours_split = PrefixSharingLM(**args, batch_tokens=100, dense_limit=30)
    for lm in (ours, ours_split):
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        assert [g for _, g in got] == [g for _, g in want]
        assert sum(g for _, g in got) >= len(contexts)
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4, rel=1e-5)


def test_view_shares_the_transformers_weights(tiny_export):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_export))
    ours = smollm3_view(hf)
    assert ours.embed.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert ours.layers[1].mlp.down.weight.data_ptr() == hf.model.layers[1].mlp.down_proj.weight.data_ptr()
    ids = torch.tensor([[5, 9, 33, 2, 7, 100]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0], -1)  # (6, V)
    ((lp, greedy),) = score_requests(ours, [([5, 9, 33], [2, 7, 100])], max_length=64)
    assert lp == pytest.approx(float(logp[2, 2] + logp[3, 7] + logp[4, 100]), abs=1e-5)
    assert greedy == bool((logp[2:5].argmax(-1) == torch.tensor([2, 7, 100])).all())
    # Another architecture: no view, PrefixSharingLM keeps lm-eval's own scoring.
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    assert smollm3_view(llama) is None


def test_read_with_yarn_both_scorings_compute_the_yarn_export_exactly(tiny_export):
    """`rope_scaling` (how the evaluation past the trained length reads a model with YaRN): the
    loaded transformers model and our view over it both compute what an export made with that
    YaRN config computes, bit for bit, at twice the trained length; lm-eval's window is the served
    length; the scores differ from plain RoPE's (the scaling is really applied)."""
    from evals.lm import PrefixSharingLM
    from model.config import RopeScaling
    from model.hf import import_hf

    lm = PrefixSharingLM(pretrained=str(tiny_export), rope_scaling=RopeScaling(2.0, 64), device="cpu", batch_size=4)
    plain = PrefixSharingLM(pretrained=str(tiny_export), max_length=128, device="cpu", batch_size=4)
    assert lm.max_length == 128 and lm.model.config.rope_parameters["rope_type"] == "yarn"
    want = import_hf(tiny_export)
    want = type(want)(want.config.with_yarn(2.0)).eval()
    want.load_state_dict(import_hf(tiny_export).state_dict())
    ids = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = want(ids).logits
        assert (lm.model(ids).logits - expected).abs().max().item() == 0.0
        assert (lm.ours(ids).logits - expected).abs().max().item() == 0.0
        # the scaling is really applied: plain RoPE computes other logits
        assert (plain.ours(ids).logits - expected).abs().max().item() > 1e-3
    request = [(ids[0, :100].tolist(), ids[0, 100:110].tolist())]
    ((yarn_lp, _),) = score_requests(lm.ours, request, max_length=lm.max_length)
    ((plain_lp, _),) = score_requests(plain.ours, request, max_length=plain.max_length)
    logp = torch.log_softmax(expected[0], -1)
    assert yarn_lp == pytest.approx(float(sum(logp[99 + i, ids[0, 100 + i]] for i in range(10))), abs=1e-4)
    plain_logp = torch.log_softmax(plain.ours(ids).logits[0], -1)
    assert plain_lp == pytest.approx(float(sum(plain_logp[99 + i, ids[0, 100 + i]] for i in range(10))), abs=1e-4)
