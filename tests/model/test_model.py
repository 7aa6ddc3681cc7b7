"""Tests for the SmolLM3 decoder (model/model.py, rope.py, layers.py; flex in test_attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.model import SmolLM3
from model.rope import positions_from_doc_ids


def _model(cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return SmolLM3(cfg, **kw).eval()


def test_forward_shapes_and_loss_is_cross_entropy_of_aligned_labels(tiny_cfg):
    model = _model(tiny_cfg)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 16))
    labels = torch.randint(0, tiny_cfg.vocab_size, (2, 16))
    labels[0, :3] = -100
    logits = model(ids).logits
    loss = model(ids, labels=labels).loss
    assert logits.shape == (2, 16, tiny_cfg.vocab_size)
    assert model(ids, labels=labels).logits is None  # the loss never materialises them
    expected = F.cross_entropy(logits.view(-1, tiny_cfg.vocab_size), labels.view(-1))
    torch.testing.assert_close(loss, expected)
    assert model(ids).loss is None


def test_causal_future_tokens_do_not_change_the_past(tiny_cfg):
    model = _model(tiny_cfg)
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % tiny_cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_packed_documents_see_only_themselves_with_positions_restarting(tiny_cfg):
    model = _model(tiny_cfg)
    doc_a = torch.randint(0, tiny_cfg.vocab_size, (1, 5))
    doc_b = torch.randint(0, tiny_cfg.vocab_size, (1, 9))
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 9])
    with torch.no_grad():
        joint = model(packed, doc_ids).logits
        alone_a, alone_b = model(doc_a).logits, model(doc_b).logits
        unmasked = model(packed).logits
    torch.testing.assert_close(joint[:, :5], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(joint[:, 5:], alone_b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[:, 5:], alone_b, atol=1e-3)


def test_positions_from_doc_ids():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_from_doc_ids(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_nope_every_nth_layer_is_configurable(tiny_cfg):
    assert [b.attn.use_rope for b in SmolLM3(tiny_cfg).layers] == [True, True, True, False]
    every_2 = tiny_cfg.replace(no_rope_interval=2)
    assert [b.attn.use_rope for b in SmolLM3(every_2).layers] == [True, False, True, False]
    none = tiny_cfg.replace(no_rope_interval=0)
    assert all(b.attn.use_rope for b in SmolLM3(none).layers)


def test_nope_layer_ignores_positions(tiny_cfg):
    """A single NoPE layer is permutation-equivariant over keys: position has no effect."""
    one_nope = tiny_cfg.replace(num_layers=1, no_rope_interval=1)
    model = _model(one_nope)
    ids = torch.randint(0, one_nope.vocab_size, (1, 6))
    doc_ids = torch.zeros_like(ids)
    shifted = torch.tensor([[0, 1, 1, 1, 1, 1]])  # last 5 tokens get positions 0..4, not 1..5
    with torch.no_grad():
        a = model(ids, doc_ids).logits
        full = model(ids).logits
        b = model(ids, shifted).logits
    torch.testing.assert_close(a, full)
    assert not torch.allclose(a[:, 1:], b[:, 1:])  # masking still changes what is seen


def test_init_weights_is_normal_002_and_seedable(tiny_cfg):
    model = SmolLM3(tiny_cfg)
    model.init_weights(seed=3)
    w = model.layers[0].mlp.gate.weight
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    other = SmolLM3(tiny_cfg)
    other.init_weights(seed=3)
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_tied_embeddings_share_one_parameter(tiny_cfg):
    tied = SmolLM3(tiny_cfg)
    assert tied.lm_head is None and tied.num_parameters() == tiny_cfg.num_parameters()
    untied = SmolLM3(tiny_cfg.replace(tie_embeddings=False))
    assert untied.num_parameters() == tiny_cfg.num_parameters() + 128 * 64


def test_z_loss_adds_squared_logsumexp(tiny_cfg):
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 8))
    plain = _model(tiny_cfg)
    with_z = _model(tiny_cfg.replace(z_loss=1e-3))
    with_z.load_state_dict(plain.state_dict())
    logits, loss = plain(ids, labels=ids, return_logits=True)
    _, loss_z = with_z(ids, labels=ids, return_logits=True)
    z = torch.logsumexp(logits.float(), -1).pow(2).mean()
    torch.testing.assert_close(loss_z, loss + 1e-3 * z)


def test_qk_norm_adds_per_head_norms_and_trains(tiny_cfg):
    cfg = tiny_cfg.replace(qk_norm=True)
    model = _model(cfg).train()
    assert model.num_parameters() == cfg.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = model(ids, torch.zeros_like(ids), labels=ids.roll(-1, 1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    assert model.layers[0].attn.q_norm.weight.grad is not None
