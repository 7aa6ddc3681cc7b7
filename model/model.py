"""SmolLM3: the decoder-only transformer trained by this project.

Design choices (all from the SmolLM3 recipe unless noted):
- pre-norm blocks: x + attn(norm(x)), then x + mlp(norm(x)); RMSNorm, eps 1e-6;
- grouped-query attention (16 query heads share 4 KV heads at 3B);
- RoPE (theta 50k) on every layer except every `no_rope_interval`-th (NoPE: 3, 7, 11, ...);
  YaRN (`rope_scaling`) only when the model is read past its trained length, never in training;
- SwiGLU feed-forward, no biases anywhere;
- tied input embedding and output head (the head is `F.linear` on the embedding weight, so
  there is one parameter to shard, checkpoint and decay-exclude);
- intra-document masking: given document ids, tokens attend only inside their document and
  RoPE positions restart at 0 for each document;
- optional QK-norm and z-loss, off by default (SmolLM3 uses neither);
- explicit `init_weights`: normal(0, 0.02) for every matrix, ones for norms.

`forward(input_ids, doc_ids=None, labels=None)` takes `labels` already aligned with the
positions (labels[:, t] is the target of input_ids[:, t], -100 = ignored); the data loader
builds them from a window of seq_len + 1 tokens. (transformers shifts inside the loss instead.)
With labels the loss is the chunked linear cross-entropy of model/loss.py, which never holds the
whole (B, T, V) logits, and `logits` is None unless `return_logits=True` asks for them too.

How it runs, set by the trainer and never part of the state dict: `activation_checkpointing`
("none" | "selective" | "full", model/recompute.py), `fused_qkv` (q, k and v as one matmul over
the three weights, model/attention.py), `loss_chunk_tokens` and `context_parallel`
(model/context_parallel.py: each rank of a CP group takes its load-balanced share of the
sequence, all-gathers keys and values, and the loss is the group's mean); tensor parallelism
(model/parallel.py) shards the blocks in place, which is why attention reads its head counts from
the tensors it is given.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import recompute
from model.attention import Attention, build_attention_mask
from model.config import ModelConfig
from model.layers import RMSNorm, SwiGLU
from model.loss import DEFAULT_CHUNK_TOKENS, IGNORE_INDEX, linear_cross_entropy
from model.rope import positions_from_doc_ids, rope_cos_sin, rope_tables

__all__ = ["IGNORE_INDEX", "CausalLMOutput", "SmolLM3"]


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor | None  # (B, T, V); None when labels were given without return_logits
    loss: torch.Tensor | None  # scalar mean cross-entropy (+ z-loss), or None without labels


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            use_rope=cfg.uses_rope(layer),
            qk_norm=cfg.qk_norm,
            eps=cfg.rms_norm_eps,
        )
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.activation_checkpointing = "none"  # what backward keeps (model/recompute.py)

    def forward(self, x, cos, sin, mask):
        return recompute.run(self._forward, self.activation_checkpointing, x, cos, sin, mask)

    def _forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)  # (B, T, H)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, H)


class SmolLM3(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = cfg
        self.attention_backend = attention_backend
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Not persistent: RoPE tables are a function of the config (rope_theta may change
        # between stages for context extension) and must never come back from a checkpoint.
        inv_freq, self.rope_scale = rope_tables(cfg)  # rope_scale: YaRN's cos/sin factor, else 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.loss_chunk_tokens = DEFAULT_CHUNK_TOKENS  # logits rows alive at once in the loss
        self.context_parallel = None  # model/context_parallel.py ContextParallel: set by the trainer
        self.init_weights()

    def set_activation_checkpointing(self, mode: str) -> None:
        """What every block keeps for backward: "none", "selective" or "full" (model/recompute.py)."""
        recompute.check_mode(mode)
        for block in self.layers:
            block.activation_checkpointing = mode

    def set_fused_qkv(self, fused: bool) -> None:
        """q, k and v as one matmul in every block (model/attention.py `_project`), or three."""
        for block in self.layers:
            block.attn.fused_qkv = bool(fused)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) for embeddings and linears, ones for norms; seeded if asked."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module.weight.is_meta:  # shape-only model (parameter counting): no values
                    continue
                w = torch.empty(module.weight.shape, dtype=torch.float32)
                w.normal_(0.0, self.config.init_std, generator=gen)
                module.weight.copy_(w)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.inv_freq.copy_(rope_tables(self.config)[0])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool = False,
    ) -> CausalLMOutput:
        B, T = input_ids.shape
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal input_ids shape {(B, T)}")
        if doc_ids is None:
            positions = torch.arange(T, device=input_ids.device)[None]  # (1, T), broadcast over B
        else:
            positions = positions_from_doc_ids(doc_ids)  # (B, T)
        cp = self.context_parallel
        if cp is not None:  # this CP rank's tokens, at their global positions (model/context_parallel.py)
            if doc_ids is None:  # plain causal attention: one document, positions 0..T-1
                doc_ids = torch.zeros_like(input_ids)
            local = cp.local_index(T, input_ids.device)  # (T / cp,)
            input_ids, positions = input_ids[:, local], positions[:, local]
            labels = labels[:, local] if labels is not None else None
        x = self.embed(input_ids)  # (B, T, H); (B, T/tp, H) under sequence parallelism
        # One additive mask for every layer, made here (outside any checkpointed block): SDPA
        # would otherwise convert the bool mask into a (B, 1, T, T) float copy in every layer.
        mask = build_attention_mask(doc_ids, self.attention_backend, cp).for_dtype(_compute_dtype(x))
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype, self.rope_scale)  # (B or 1, 1, T, hd) each
        for block in self.layers:
            x = block(x, cos, sin, mask)  # (B, T, H)
        x = self.norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        loss = None
        if labels is not None and cp is None:
            loss = linear_cross_entropy(x, head, labels, chunk_tokens=self.loss_chunk_tokens, z_loss=self.config.z_loss)
        elif labels is not None:  # the mean over the CP group's targets, on every CP rank
            count = cp.count((labels != IGNORE_INDEX).sum().float())
            share = linear_cross_entropy(
                x, head, labels, chunk_tokens=self.loss_chunk_tokens, z_loss=self.config.z_loss, count=count
            )
            loss = cp.sum(share)
        logits = self.logits(x, head) if labels is None or return_logits else None
        return CausalLMOutput(logits, loss)

    @staticmethod
    def logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits of the final hidden states (whole tensors under tensor parallelism)."""
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        if hasattr(head, "full_tensor"):
            head = head.full_tensor()
        return F.linear(x, head)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when on, else the activations' own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
