"""The training loss: linear head + cross-entropy over chunks of tokens, never the whole logits.

`linear_cross_entropy(hidden, weight, labels)` is the mean cross-entropy of `hidden @ weight.T`
against `labels` over the non-ignored targets (plus z-loss when asked), as
`F.cross_entropy(F.linear(hidden, weight).float(), labels)` computes it, but:

- the logits exist one chunk of `chunk_tokens` rows at a time (chunk x vocabulary fp32, plus the
  matmul's own dtype when it is bf16): at seq 65,536 and vocabulary 128,256 the whole logits tensor
  would be 16.8 GB in bf16 and twice that in fp32, and its gradient as much again;
- the gradients are computed in the same pass (as Liger-Kernel's fused linear cross-entropy does):
  per chunk, softmax - one-hot (scaled for the mean and the z-loss) times the weight gives the
  hidden states' gradient, and its transpose times the chunk's hidden states accumulates the
  weight's gradient in fp32. Backward only scales them by the incoming gradient, so the head costs
  the same three matmuls as without chunking and nothing is recomputed. What stays between forward
  and backward is one hidden-sized gradient and one fp32 weight-sized gradient (model/memory.py
  counts both);
- under tensor parallelism the weight is the vocabulary-sharded DTensor of the tied embedding
  (model/parallel.py): each rank computes its vocabulary slice and the softmax is completed with
  three all-reduces per chunk over the TP group (max, sum of exponentials, target logit), the
  Megatron vocab-parallel cross-entropy; the sequence-parallel hidden states are all-gathered first
  and their gradient is reduce-scattered back (DTensor does both).

The matmul runs in the dtype autocast would pick (or the inputs' own), the softmax in fp32, as the
unfused path did. Equality with that path (loss and both gradients within fp32 tolerance) and the
memory bound are tested in tests/model/test_loss.py, where the unfused path is the oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
DEFAULT_CHUNK_TOKENS = 1024  # rows of logits alive at once (x vocabulary / tp x 4 bytes, + bf16 copy)


def reference_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0
) -> torch.Tensor:
    """The unfused loss, logits and all (the test oracle; what the model computed before)."""
    logits = torch.nn.functional.linear(hidden, weight)
    flat = logits.float().view(-1, logits.shape[-1])  # (N, V), fp32 for a stable softmax
    targets = labels.reshape(-1)
    loss = torch.nn.functional.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    if z_loss > 0:
        valid = targets != IGNORE_INDEX
        loss = loss + z_loss * torch.logsumexp(flat[valid], dim=-1).pow(2).mean()
    return loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    z_loss: float = 0.0,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy (+ z-loss) of `hidden` (..., H) through the head `weight` (V, H) against
    `labels` (...) (IGNORE_INDEX = no target); DTensor inputs of tensor parallelism are handled.
    `count`: the number of targets the sum is divided by (default: the valid targets of `labels`;
    context parallelism passes its group's, so each rank computes its share of the group's mean)."""
    if chunk_tokens <= 0:
        raise ValueError(f"loss chunk_tokens must be positive, got {chunk_tokens}")
    group, vocab_start = None, 0
    if _is_dtensor(weight):
        from torch.distributed.tensor import Partial, Replicate

        mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"the loss expects the head sharded over one (TP) mesh dimension, got {mesh.ndim}")
        if _is_dtensor(hidden):
            # Sequence-parallel hidden states: gather the sequence; each rank's gradient is a
            # partial sum over its vocabulary slice (reduce-scattered back by DTensor).
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        local = weight.to_local()
        group = mesh.get_group()
        vocab_start = mesh.get_local_rank() * local.shape[0]
        if local.shape[0] * mesh.size() != weight.shape[0]:
            raise ValueError(
                f"vocabulary {weight.shape[0]} is not divisible by the tensor-parallel degree {mesh.size()}"
            )
        weight = local
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    targets = labels.reshape(-1).to(flat.device)  # (N,)
    if targets.shape[0] != flat.shape[0]:
        raise ValueError(f"labels hold {targets.shape[0]} targets for {flat.shape[0]} hidden states")
    return _LinearCrossEntropy.apply(flat, weight, targets, chunk_tokens, float(z_loss), group, vocab_start, count)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the head matmul: autocast's when it is on (as F.linear would run), else the input's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, z_loss, group, vocab_start, count=None):
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # no copy unless autocast changes the dtype
            valid = targets != IGNORE_INDEX
            count = valid.sum().to(torch.float32) if count is None else count.to(torch.float32)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            total_z = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk].to(dtype)  # (c, H)
                t = targets[start : start + chunk]
                v = valid[start : start + chunk]
                lse, target_logit, probs = _chunk_softmax(h, w, t, v, group, vocab_start)
                total += torch.where(v, lse - target_logit, 0.0).sum()
                if z_loss:
                    total_z += torch.where(v, lse.square(), 0.0).sum()
                if need_h or need_w:
                    g = _logit_grad(probs, lse, t, v, count, z_loss, vocab_start).to(dtype)  # (c, V)
                    if need_h:
                        grad_h[start : start + chunk] = g @ w
                    if need_w:
                        if g.dtype == torch.float32:
                            grad_w.addmm_(g.t(), h)
                        else:
                            grad_w.add_(g.t() @ h)  # accumulate the bf16 products in fp32
                    del g
                del probs  # before the next chunk's logits: one chunk alive at a time
            loss = total / count
            if z_loss:
                loss = loss + z_loss * total_z / count
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype, ctx.done = weight.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.done:  # the stored gradients are scaled in place: a second backward would be wrong
            raise RuntimeError("linear_cross_entropy supports one backward per forward (no retain_graph)")
        ctx.done = True
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out.to(torch.float32)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_softmax(h, w, t, v, group, vocab_start):
    """(logsumexp, target logit, softmax) of one chunk's logits (c, V_local), fp32; over the TP
    group when the vocabulary is sharded. The softmax is built in place in the logits' buffer."""
    logits = (h @ w.t()).float()  # (c, V_local); .float() is a copy only for bf16
    local = t - vocab_start
    here = v & (local >= 0) & (local < logits.shape[1])
    target_logit = torch.where(here, logits.gather(1, torch.where(here, local, 0)[:, None]).squeeze(1), 0.0)
    row_max = logits.max(dim=1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    probs = logits.sub_(row_max[:, None]).exp_()  # exp(l - max), in place
    sumexp = probs.sum(dim=1)
    if group is not None:
        dist.all_reduce(sumexp, group=group)
        dist.all_reduce(target_logit, group=group)
    probs.div_(sumexp[:, None])  # softmax, in place
    return sumexp.log() + row_max, target_logit, probs


def _logit_grad(probs, lse, t, v, count, z_loss, vocab_start):
    """d loss / d logits for one chunk, in place in `probs`: (softmax (1 + 2 z lse) - one-hot) /
    count on rows with a target, 0 on ignored rows."""
    scale = torch.where(v, (1.0 + 2.0 * z_loss * lse) / count, 0.0) if z_loss else torch.where(v, 1.0 / count, 0.0)
    probs.mul_(scale[:, None])
    local = t - vocab_start
    here = v & (local >= 0) & (local < probs.shape[1])
    # The one-hot term, one index per row (no data-dependent shapes: fake tensors trace it too).
    minus = torch.where(here, -1.0 / count, 0.0).to(probs.dtype)[:, None]
    probs.scatter_add_(1, torch.where(here, local, 0)[:, None], minus)
    return probs
