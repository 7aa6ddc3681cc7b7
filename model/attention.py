"""Grouped-query causal self-attention with optional RoPE, QK-norm and document masking.

Masking backends, chosen once per forward by `build_attention_mask`:
- no document ids: SDPA with `is_causal=True` and native GQA (the fast path everywhere);
- document ids on CPU (or flex unavailable): SDPA with a dense block-diagonal causal bool mask,
  (B, 1, T, T). FlexAttention has no backward on CPU, so CPU training always takes this path;
- document ids on CUDA with FlexAttention available: a compiled `flex_attention` with a
  BlockMask, which skips fully masked blocks instead of materialising T x T. Forcing "flex" on CPU
  runs `flex_attention` uncompiled (torch's reference implementation, T x T like the dense path):
  it exists to test the mask, and inductor's CPU kernel for it is wrong on AVX2 (below).

The flex path pads q, k, v (and the document ids, with a document of its own) to a multiple of
FLEX_BLOCK and slices the output back, so the kernel only ever sees whole blocks: the non-divisible
kernel variants are where bugs live (on CUDA, pytorch#153799: NaN in backward). Padded keys come
after every real query, so causality alone keeps them out of real outputs; padded rows are
discarded. Block-multiple lengths (GPU training shapes) pad nothing.

Why the CPU path is not compiled (measured, torch 2.13, inductor's C++ template with AVX2 kernels,
i.e. ATEN_CPU_CAPABILITY=avx2 or an AVX2-only host; the AVX512 kernels agree with dense):
- a sequence shorter than one block whose length is 8 mod 16 (24, 40, 56, ...) with head_dim < 24:
  the transposed micro-GEMM takes its full 16-column path for the 8-column tail and writes 8 floats
  past the T x T score tile into the softmax running max; rows 0-7 come out wrong (max abs error
  3.1 at T=40, NaN when the stray value is);
- batch 2 with per-row document masks at T=128 (a whole block, so padding does not help): every
  row wrong (max abs error 2.6); batch 1 and 3, or a batch-broadcast BlockMask, agree.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.layers import RMSNorm
from model.rope import apply_rope

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5: no FlexAttention; the dense mask serves every device
    create_block_mask = flex_attention = None


@dataclass
class AttentionMask:
    """What every layer of one forward pass attends with."""

    kind: str  # "causal" | "dense" | "flex"
    # kind "dense": (B, 1, T, T), bool (True = may attend) or, after `for_dtype`, additive (0 / -inf)
    dense: torch.Tensor | None = None
    block_mask: Any = None  # flex BlockMask over T + flex_pad positions; kind "flex"
    flex_pad: int = 0  # kind "flex": zero positions appended so (T + flex_pad) % FLEX_BLOCK == 0
    kv_pad: int | None = None  # kind "flex" under CP: the same for the gathered keys (None: flex_pad)
    # Context parallelism (model/context_parallel.py): keys and values are all-gathered over the
    # CP group before attention, and the mask is this rank's query rows against the whole sequence.
    context: Any = None

    def for_dtype(self, dtype: torch.dtype) -> AttentionMask:
        """This mask with a dense bool mask turned into the additive float mask SDPA would build
        from it (0 where allowed, -inf elsewhere: the same values, so the same outputs), once for
        every layer instead of once per layer, each copy kept for backward."""
        if self.kind != "dense" or self.dense.dtype != torch.bool:
            return self
        additive = torch.zeros(self.dense.shape, dtype=dtype, device=self.dense.device)
        additive = additive.masked_fill_(self.dense.logical_not(), float("-inf"))
        return AttentionMask("dense", dense=additive, context=self.context)


FLEX_BLOCK = 128  # BlockMask block size (torch's default), the unit the flex path pads T to
PAD_DOC = -1  # document id of the padding (real ids are >= 0, see model.token_shards.Batch)


def flex_available() -> bool:
    return flex_attention is not None


@functools.cache
def _compiled_flex():
    # Uncompiled flex attention materialises the full score matrix; compiling is the point.
    return torch.compile(flex_attention, dynamic=False)


@torch.compiler.disable  # never handed to inductor, even inside a compiled block
def _flex_cpu(q, k, v, block_mask):
    # Inductor's CPU kernel is wrong on AVX2 (module docstring): the reference implementation.
    with warnings.catch_warnings():  # its "materialises the scores" warning: on purpose here
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _flex(q, k, v, block_mask):
    if not q.is_cuda:
        return _flex_cpu(q, k, v, block_mask)
    if torch.compiler.is_compiling():  # inside a compiled block: its compile builds the kernel
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)


def build_attention_mask(doc_ids: torch.Tensor | None, backend: str = "auto", context=None) -> AttentionMask:
    """Mask for (B, T) document ids; backend "auto" | "sdpa" | "flex" ("flex" forces it). With
    `context` (model/context_parallel.py `ContextParallel`), `doc_ids` are the whole sequence's and
    the mask is this CP rank's query rows against the all-gathered keys."""
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"attention backend must be auto, sdpa or flex, got {backend!r}")
    if doc_ids is None:
        if context is not None:
            raise ValueError("context parallelism needs document ids (all zeros for plain causal attention)")
        return AttentionMask("causal")
    B, T = doc_ids.shape
    use_flex = backend == "flex" or (backend == "auto" and doc_ids.is_cuda and flex_available())
    if use_flex and not flex_available():
        raise RuntimeError(
            f"attention backend 'flex' needs torch >= 2.5, this is {torch.__version__}: "
            "use attention_backend 'sdpa' (or 'auto') or upgrade torch"
        )
    if context is not None:
        return _context_parallel_mask(doc_ids, use_flex, context)
    if use_flex:
        pad = -T % FLEX_BLOCK
        docs = F.pad(doc_ids, (0, pad), value=PAD_DOC) if pad else doc_ids  # (B, T + pad)

        def same_doc_causal(b, h, q_idx, kv_idx):
            return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

        n = T + pad
        block = create_block_mask(same_doc_causal, B, None, n, n, device=doc_ids.device, BLOCK_SIZE=FLEX_BLOCK)
        return AttentionMask("flex", block_mask=block, flex_pad=pad)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return AttentionMask("dense", dense=(same & causal)[:, None])  # (B, 1, T, T)


def _context_parallel_mask(doc_ids: torch.Tensor, use_flex: bool, context) -> AttentionMask:
    """This CP rank's rows of the CP 1 mask: query i is global token `q_at[i]`, gathered key j is
    global token `kv_at[j]`; same document and causal on those global indices, so the mask is
    exact whatever the load-balanced order."""
    B, T = doc_ids.shape
    q_at = context.local_index(T, doc_ids.device)  # (T / cp,)
    kv_at = context.gathered_index(T, doc_ids.device)  # (T,)
    if not use_flex:
        causal = q_at[:, None] >= kv_at[None, :]  # (T / cp, T)
        same = doc_ids[:, q_at, None] == doc_ids[:, None, kv_at]  # (B, T / cp, T)
        return AttentionMask("dense", dense=(same & causal)[:, None], context=context)  # (B, 1, T / cp, T)
    n_q = q_at.shape[0]
    q_pad, kv_pad = -n_q % FLEX_BLOCK, -T % FLEX_BLOCK
    q_docs = F.pad(doc_ids[:, q_at], (0, q_pad), value=PAD_DOC)  # (B, T / cp + q_pad)
    kv_docs = F.pad(doc_ids[:, kv_at], (0, kv_pad), value=PAD_DOC)  # (B, T + kv_pad)
    q_at = F.pad(q_at, (0, q_pad), value=T)
    kv_at = F.pad(kv_at, (0, kv_pad), value=T)

    def same_doc_causal(b, h, q_idx, kv_idx):
        # Padded query rows attend to everything (never empty); their outputs are sliced off.
        real = (q_docs[b, q_idx] == kv_docs[b, kv_idx]) & (q_at[q_idx] >= kv_at[kv_idx])
        return real | (q_idx >= n_q)

    n_kv = T + kv_pad
    block = create_block_mask(same_doc_causal, B, None, n_q + q_pad, n_kv, device=doc_ids.device, BLOCK_SIZE=FLEX_BLOCK)
    return AttentionMask("flex", block_mask=block, flex_pad=q_pad, kv_pad=kv_pad, context=context)


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        use_rope: bool,
        qk_norm: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden // num_heads
        self.use_rope = use_rope
        kv = num_kv_heads * self.head_dim
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv, bias=False)
        self.v = nn.Linear(hidden, kv, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        # q, k, v as one matmul (`_project`); how it runs, never the math: set by the trainer
        self.fused_qkv = False
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of `x`: three matmuls, or with `fused_qkv` one over the three weights
        concatenated at forward time (the parameters, their names, the checkpoint and the HF
        export stay three). Under tensor parallelism the weights are DTensors sharded by rows
        (column-parallel) and `x` the replicated sequence: the fused matmul runs on the local
        shards, whose concatenation holds exactly this rank's q, k and v heads; the gradient of
        `x` is then this rank's partial sum, which the all-gather's backward reduce-scatters, as
        ColwiseParallel's own backward does."""
        if not self.fused_qkv:
            return self.q(x), self.k(x), self.v(x)
        weights = (self.q.weight, self.k.weight, self.v.weight)
        if hasattr(x, "to_local"):  # a DTensor: tensor parallelism (imported only then: ~1 s)
            from torch.distributed.tensor import Partial

            x = x.to_local(grad_placements=[Partial()] * len(x.placements))  # (B, T, H) whole
            weights = tuple(w.to_local() for w in weights)
        qkv = F.linear(x, torch.cat(weights))  # (B, T, (nh + 2 nkv) hd / tp)
        return qkv.split([w.shape[0] for w in weights], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        B, T = x.shape[:2]
        hd = self.head_dim
        # Head counts from the projections: under tensor parallelism each rank holds nh / tp
        # query and nkv / tp key/value heads (model/parallel.py), and x is the gathered sequence.
        q, k, v = self._project(x)  # (B, T, nh hd), (B, T, nkv hd) x 2: local heads under TP
        q = q.view(B, T, -1, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        nh, nkv = q.shape[1], k.shape[1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask.context is not None:  # CP: every key and value of the sequence, rotated where it sits
            k, v = mask.context.gather(k), mask.context.gather(v)  # (B, nkv, S, hd), S = T x cp
        S = k.shape[2]
        if mask.kind == "flex":
            kv_pad = mask.flex_pad if mask.kv_pad is None else mask.kv_pad
            if mask.flex_pad:  # whole blocks only (see the module docstring)
                q = F.pad(q, (0, 0, 0, mask.flex_pad))
            if kv_pad:
                k, v = F.pad(k, (0, 0, 0, kv_pad)), F.pad(v, (0, 0, 0, kv_pad))
            y = _flex(q, k, v, mask.block_mask)
            y = y[:, :, :T]  # (B, nh, T, hd)
        elif mask.kind == "causal":
            # Native GQA: no copies of k/v; SDPA keeps its fused kernels without a mask.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif not q.is_cuda:
            # The CPU flash kernel also takes GQA with a mask (measured faster than expanding).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True)
        else:
            # CUDA kernels fall back to math for GQA with a mask: expand the kv heads instead.
            rep = nh // nkv
            k = k[:, :, None].expand(B, nkv, rep, S, hd).reshape(B, nh, S, hd)
            v = v[:, :, None].expand(B, nkv, rep, S, hd).reshape(B, nh, S, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
        y = y.transpose(1, 2).reshape(B, T, nh * hd)  # (B, T, H / tp)
        return self.o(y)
