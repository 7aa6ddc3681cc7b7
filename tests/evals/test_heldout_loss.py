"""evals/heldout_loss.py: the bytes of text each token covers, bits per byte against a hand
computation and against uniform guessing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from evals.heldout_loss import heldout_loss, heldout_scores, token_bytes
from model.config import ModelConfig
from model.model import SmolLM3

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Café déjà vu: naïve façade, 東京 and Zürich — emoji 🙂 too.",
    "def f(x):\n    return x * 2  # doubled\n",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from curation.bpe import save_hf_tokenizer, train_bpe

    out = tmp_path_factory.mktemp("tok")
    save_hf_tokenizer(train_bpe(iter(TEXTS * 20), vocab_size=320), out)
    return out


def test_token_bytes_count_every_byte_of_a_document_once(tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for text in [*TEXTS, "🙂🙂", "x"]:
        enc = tok.encode(text)
        counts = token_bytes(text, enc.offsets)
        assert len(counts) == len(enc.ids) and sum(counts) == len(text.encode("utf-8")), text
        assert all(c >= 0 for c in counts)
    # Offsets that skip text (a normaliser dropping characters) give it to the next token.
    assert token_bytes("a  b", [(0, 1), (3, 4)]) == [1, 3]
    assert token_bytes("abc!", [(0, 3)]) == [4]  # a trailing rest goes to the last token
    with pytest.raises(ValueError, match="produced no tokens"):
        token_bytes("text", [])


def _model(vocab: int = 64) -> SmolLM3:
    cfg = ModelConfig.tiny(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_seq_len=64,
    )
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    return model.eval()


def test_bits_per_byte_is_nats_of_text_over_ln2_over_bytes():
    torch.manual_seed(0)
    model = _model()
    tokens = torch.randint(1, 64, (8 * 16 + 1,))
    tokens[::7] = 0  # documents end here and there (EOS id 0)
    nbytes = torch.randint(1, 5, tokens.shape)
    nbytes[tokens == 0] = 0
    s = heldout_scores(model, tokens, nbytes, seq_len=16, batch=3, eos_id=0)
    # By hand: every target once, EOS targets out of BPB, windows with document masking.
    x, y = tokens[:-1].view(8, 16), tokens[1:].view(8, 16)
    ends = (x == 0).long()
    docs = torch.cumsum(ends, 1) - ends
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model(x, docs).logits.flatten(0, 1), y.flatten(), reduction="none").view(
            8, 16
        )
    text = y != 0
    want = float((ce * text).sum()) / math.log(2) / float(nbytes[1:].sum())
    assert s["bpb"] == pytest.approx(want, rel=1e-6) and s["bpb_stderr"] > 0
    assert s["loss"] == pytest.approx(heldout_loss(model, tokens, 16, 3, 0)[0], rel=1e-6)
    assert s["random_bpb"] == pytest.approx(math.log2(64) * float(text.sum()) / float(nbytes[1:].sum()))
    # A model that guesses uniformly (zero logits) scores exactly the random BPB.
    with torch.no_grad():
        model.embed.weight.zero_()
    uniform = heldout_scores(model, tokens, nbytes, seq_len=16, batch=3, eos_id=0)
    assert uniform["bpb"] == pytest.approx(uniform["random_bpb"], rel=1e-6)
    assert uniform["loss"] == pytest.approx(math.log(64), rel=1e-6)


def test_heldout_loss_matches_the_model_loss():
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    model.eval()
    tokens = torch.randint(1, 64, (16 * 8 + 1,))
    mean, se = heldout_loss(model, tokens, seq_len=16, batch=3, eos_id=0)
    with torch.no_grad():
        x, y = tokens[:-1].view(8, 16), tokens[1:].view(8, 16)
        ref = model(x, torch.zeros_like(x), y).loss.item()
    assert mean == pytest.approx(ref, rel=1e-5) and se > 0
    with pytest.raises(ValueError, match="shorter than one 16-token window"):
        heldout_loss(model, tokens[:10], 16, 3, 0)
