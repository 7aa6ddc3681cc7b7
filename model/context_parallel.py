"""Context parallelism (CP): the sequence of each micro-batch split over the ranks of a CP group.

Design choices:
- load balancing: the sequence is cut into 2 x cp chunks and CP rank r holds chunks r and
  2 cp - 1 - r (torchtitan's and Megatron's layout), so under the causal mask every rank's queries
  see about the same number of keys: rank 0 has the first and the last chunk, rank cp-1 the two
  middle ones. `local_index` is the global token index of each local token;
- all-gather KV, not ring attention: each rank all-gathers the (RoPE-rotated) keys and values of
  its CP group and computes its own queries against the whole sequence, with the mask built from
  GLOBAL token indices and document ids (model/attention.py `build_attention_mask`). The mask is
  then exactly the one of CP 1 restricted to this rank's query rows, for every backend (SDPA's
  dense mask, FlexAttention's BlockMask), so document masking needs no per-step ring logic and
  FlexAttention needs no merging of partial softmaxes across ranks. Its cost is one all-gather of
  K and V per layer (GQA keeps them small: 4 KV heads of 16 at 3B) and the gathered K/V kept for
  backward (model/memory.py counts them); its backward reduce-scatters the K/V gradients;
- RoPE positions are computed on the whole sequence (they restart at each document) and then
  sliced, so every local token is rotated by its global position;
- the loss is the mean over the CP group's tokens: each rank sums its own token losses, divides
  by the group's target count and the shares are summed with an all-reduce whose backward is an
  all-reduce too. Every CP rank then holds the loss of CP 1, and FSDP's average over the DP x CP
  ranks gives the gradient of CP 1 (model/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def local_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len / cp,) global indices of CP rank `rank`'s tokens: chunks `rank` and 2 cp - 1 - rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_index(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len,) global index of each position of the all-gathered sequence (rank order)."""
    return torch.cat([local_index(seq_len, cp, r, device) for r in range(cp)])


# torch 2.13 renamed the tensor collectives (the old names warn); older torch has the old ones only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of (B, heads, S_local, hd)) in rank order; the
    backward reduce-scatters the gradient, so each rank gets the sum of every rank's gradient of
    its own keys and values."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        front = x.movedim(2, 0).contiguous()  # (S_local, B, heads, hd)
        out = front.new_empty((size * front.shape[0], *front.shape[1:]))
        _all_gather(out, front, group=group)
        return out.movedim(0, 2)  # (B, heads, S, hd)

    @staticmethod
    def backward(ctx, grad):
        front = grad.movedim(2, 0).contiguous()  # (S, B, heads, hd)
        out = front.new_empty((front.shape[0] // ctx.size, *front.shape[1:]))
        _reduce_scatter(out, front, group=ctx.group)
        return out.movedim(0, 2), None, None


class _SumOverGroup(torch.autograd.Function):
    """A sum over the group whose backward is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its CP group: what the model needs to shard a sequence and gather K/V."""

    group: object  # the CP process group (the device mesh's "cp" dimension)
    size: int
    rank: int

    @classmethod
    def of(cls, group) -> ContextParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def local_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return local_index(seq_len, self.size, self.rank, device)

    def gathered_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return gathered_index(seq_len, self.size, device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, heads, S/cp, hd) -> (B, heads, S, hd), in `gathered_index` order."""
        return _GatherSequence.apply(x, self.group, self.size)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the CP group, differentiable (its backward sums the gradients)."""
        return _SumOverGroup.apply(x, self.group)

    def count(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the CP group of a tensor that needs no gradient (a target count)."""
        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out
