"""lm-eval model for our SmolLM3 exports: lm-eval's `hf` model with log-likelihoods scored once
per shared context.

lm-eval's `hf` model scores each (context, choice) request as its own sequence, so a 4-choice
item runs its context through the model 4 times, and it computes full-vocabulary logits at every
position. On the tiny recipe that is ~3x the forward work needed (measured: 143k tokens for the
three cloze tasks against 52k with each context scored once); the forward passes, not set-up,
were 75% of `evaluate`'s time (see benchmarks/eval_cost.py).

`PrefixSharingLM` is `lm_eval.models.huggingface.HFLM` (same tokenisation, truncation, request
plumbing, `generate_until` and rolling log-likelihoods, same results structure) with one method
replaced: `_loglikelihood_tokens`. It groups requests whose model input before the continuation
is identical (the choices of one item), lays each group out as one row [context | choice 1 |
choice 2 | ...] with a mask that lets every choice see the context and itself but not the other
choices, and RoPE positions that continue the context in every branch, so each choice's
log-probability is the one the `hf` model computes for it alone. Logits are computed only at the
positions that predict continuation tokens. The forward pass runs on our `model.SmolLM3` modules,
sharing the loaded transformers model's weight tensors (no copy); exports of other architectures
(or SmolLM3 variants our model does not express) fall back to the `hf` scoring unchanged.

Equality with the stock `hf` model is a test (tests/tasks/test_eval_lm.py): same log-likelihoods
within float tolerance and the same greedy flags, hence the same acc / acc_norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from model.attention import AttentionMask
from model.model import SmolLM3
from model.rope import inv_frequencies, rope_cos_sin

# One request as lm-eval hands it to `_loglikelihood_tokens`: (cache key, context, continuation).
Request = tuple[tuple[str, str] | None, list[int], list[int]]


def smollm3_view(hf_model) -> SmolLM3 | None:
    """Our SmolLM3 over the weight tensors of a loaded `SmolLM3ForCausalLM` (no copy), or None
    when the model is another architecture or uses features our model does not have."""
    from model.hf import from_hf_config, from_hf_state_dict

    config = hf_model.config
    if getattr(config, "model_type", None) != "smollm3":
        return None
    if getattr(config, "use_sliding_window", False) or getattr(config, "attention_bias", False) \
            or getattr(config, "mlp_bias", False):
        return None
    try:
        cfg = from_hf_config(config)
        weights = from_hf_state_dict(hf_model.state_dict(), cfg)
    except (KeyError, ValueError):
        return None
    device = next(hf_model.parameters()).device
    with torch.device("meta"):
        ours = SmolLM3(cfg)
    ours.load_state_dict(weights, assign=True, strict=True)
    # RoPE tables are not weights: build them on the model's device.
    ours.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta).to(device)
    return ours.eval()


@dataclass
class _Row:
    """One group laid out as [prefix | branch 1 inputs | branch 2 inputs | ...]."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    branch: list[int] = field(default_factory=list)  # 0 = shared prefix, j = j-th continuation
    # Per scored request: (request index, row indices whose outputs predict it, its tokens).
    scored: list[tuple[int, list[int], list[int]]] = field(default_factory=list)


def _rows(requests: list[tuple[list[int], list[int]]], max_length: int) -> list[_Row]:
    """Group requests by the model input that precedes their continuation and pack each group
    into rows of at most `max_length` tokens (a group too long for one row repeats its prefix)."""
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for i, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"loglikelihood request {i} has an empty continuation")
        if len(continuation) > max_length:
            raise ValueError(
                f"loglikelihood request {i}: continuation of {len(continuation)} tokens exceeds the "
                f"model's {max_length}-token window; shorten the task's choices"
            )
        # The `hf` model's window: the last max_length + 1 tokens, minus the final one.
        whole = (context + continuation)[-(max_length + 1):]
        prefix = tuple(whole[: len(whole) - len(continuation)])
        groups.setdefault(prefix, []).append((i, continuation))
    rows: list[_Row] = []
    for prefix, members in groups.items():
        row = None
        for i, continuation in members:
            inputs = continuation[:-1]  # the last token is predicted, never fed
            if row is None or len(row.tokens) + len(inputs) > max_length:
                row = _Row(list(prefix), list(range(len(prefix))), [0] * len(prefix))
                rows.append(row)
            start, branch = len(row.tokens), len(row.scored) + 1
            row.tokens += inputs
            row.positions += range(len(prefix), len(prefix) + len(inputs))
            row.branch += [branch] * len(inputs)
            row.scored.append((i, [len(prefix) - 1, *range(start, start + len(inputs))], continuation))
    return rows


def _mask(branch: torch.Tensor) -> torch.Tensor:
    """(B, T) branch ids (-1 = padding) -> (B, 1, T, T) bool: causal, and a continuation sees
    the shared prefix and its own tokens only. Padding attends to itself (never all-masked)."""
    T = branch.shape[1]
    idx = torch.arange(T, device=branch.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T): key <= query
    q, k = branch[:, :, None], branch[:, None, :]  # (B, T, 1), (B, 1, T)
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))  # (B, T, T)
    allowed |= torch.eye(T, dtype=torch.bool, device=branch.device) & (q < 0)
    return allowed[:, None]


@torch.no_grad()
def score_requests(
    model: SmolLM3, requests: list[tuple[list[int], list[int]]], max_length: int,
    batch_tokens: int = 4096,
) -> list[tuple[float, bool]]:
    """(log-probability of the continuation, whether it is the greedy continuation) for each
    (context tokens, continuation tokens) request, as lm-eval's `hf` model defines them."""
    device = model.embed.weight.device
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    logprob = torch.zeros(len(requests), dtype=torch.float64)
    misses = torch.zeros(len(requests), dtype=torch.int64)
    rows = sorted(_rows(requests, max_length), key=lambda r: -len(r.tokens))
    start = 0
    while start < len(rows):
        # Longest first: the batch's first row sets its padded length.
        width = len(rows[start].tokens)
        batch = rows[start : start + max(1, batch_tokens // width)]
        start += len(batch)
        B = len(batch)
        ids = torch.zeros(B, width, dtype=torch.long)
        pos = torch.zeros(B, width, dtype=torch.long)
        branch = torch.full((B, width), -1, dtype=torch.long)
        at_b, at_t, targets, owner = [], [], [], []
        for b, row in enumerate(batch):
            n = len(row.tokens)
            ids[b, :n], pos[b, :n], branch[b, :n] = (torch.tensor(row.tokens), torch.tensor(row.positions),
                                                     torch.tensor(row.branch))
            for i, where, tokens in row.scored:
                at_b += [b] * len(where)
                at_t += where
                targets += tokens
                owner += [i] * len(tokens)
        ids, pos, branch = ids.to(device), pos.to(device), branch.to(device)
        x = model.embed(ids)  # (B, T, H)
        cos, sin = rope_cos_sin(pos, model.inv_freq, x.dtype)  # (B, 1, T, hd) each
        mask = AttentionMask("dense", dense=_mask(branch))
        for block in model.layers:
            x = block(x, cos, sin, mask)  # (B, T, H)
        h = model.norm(x)[torch.tensor(at_b, device=device), torch.tensor(at_t, device=device)]  # (N, H)
        logp = F.log_softmax(F.linear(h, head).float(), dim=-1)  # (N, V), only where scored
        target = torch.tensor(targets, device=device)
        token_lp = logp.gather(1, target[:, None])[:, 0].double().cpu()  # (N,)
        missed = (logp.argmax(dim=-1) != target).long().cpu()  # (N,)
        who = torch.tensor(owner)
        logprob.index_add_(0, who, token_lp)
        misses.index_add_(0, who, missed)
    return [(float(lp), bool(m == 0)) for lp, m in zip(logprob.tolist(), misses.tolist(), strict=True)]


class PrefixSharingLM(HFLM):
    """lm-eval's `hf` model whose log-likelihood requests are scored once per shared context on
    our SmolLM3 (see the module docstring). `batch_tokens` bounds the padded tokens per forward."""

    def __init__(self, pretrained: str, batch_tokens: int = 4096, **kwargs) -> None:
        super().__init__(pretrained=pretrained, **kwargs)
        if batch_tokens <= 0:
            raise ValueError(f"batch_tokens must be > 0, got {batch_tokens}")
        self.batch_tokens = batch_tokens
        self.ours = smollm3_view(self.model)

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        if self.ours is None:  # not a SmolLM3 our model can run: the `hf` path, unchanged
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        answers = score_requests(self.ours, [(ctx, cont) for _, ctx, cont in requests],
                                 self.max_length, self.batch_tokens)
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:  # rolling windows come with no key: lm-eval caches those itself
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers
