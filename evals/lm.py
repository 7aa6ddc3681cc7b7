"""lm-eval model for our SmolLM3 exports: lm-eval's `hf` model with every shared prefix scored
once.

lm-eval's `hf` model scores each (context, choice) request as its own sequence, so a 4-choice
item runs its context through the model 4 times, and it computes full-vocabulary logits at every
position. On the tiny suite's cloze tasks that is 143k tokens of forward work where 51k suffice;
profiled at 1 thread, the forward passes (not model or task set-up) were ~75% of `evaluate`.

`PrefixSharingLM` is `lm_eval.models.huggingface.HFLM` (same tokenisation, truncation, request
plumbing, `generate_until` and rolling log-likelihoods, same results structure) with one method
replaced: `_loglikelihood_tokens`. Each request's model input (lm-eval's window: the last
max_length + 1 tokens of context + continuation, minus the last) becomes a path in a prefix tree
laid out depth-first in a row: the choices of an item share their context, passkey items share
their filler. A mask lets each token attend to its ancestors only and RoPE positions are depths,
so every request gets exactly the log-probability the `hf` model computes for it alone. Logits
are computed only at positions that predict continuation tokens. The forward pass runs on our
`model.SmolLM3` modules over the loaded transformers model's weight tensors (no copy); other
architectures (or SmolLM3 variants our model does not express) keep the `hf` scoring.

Equality with the stock `hf` model is a test (tests/evals/test_lm.py): same log-likelihoods
within float tolerance and the same greedy flags, hence the same acc / acc_norm.

Progress: `EvalProgress` is lm-eval's cache hook used as a meter. lm-eval's `hf` code reports
every answered request to `cache_hook.add_partial`; `PrefixSharingLM` does the same as each batch
finishes and, before each request type runs, tells the hook which requests come (task, document),
so it can log items done per task and an ETA while lm-eval runs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import CacheHook
from lm_eval.models.huggingface import HFLM

from infra.progress import Progress
from model.attention import AttentionMask
from model.config import RopeScaling
from model.model import SmolLM3
from model.rope import rope_cos_sin, rope_tables

# One request as lm-eval hands it to `_loglikelihood_tokens`: (cache key, context, continuation).
Request = tuple[tuple[str, str] | None, list[int], list[int]]


def smollm3_view(hf_model) -> SmolLM3 | None:
    """Our SmolLM3 over the weight tensors of a loaded `SmolLM3ForCausalLM` (no copy), or None
    when the model is another architecture or uses features our model does not have."""
    from model.hf import from_hf_config, from_hf_state_dict, unsupported_features

    config = hf_model.config
    if unsupported_features(config):  # the one check `import_hf` and `pin` refuse by
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
    inv_freq, ours.rope_scale = rope_tables(cfg)
    ours.inv_freq = inv_freq.to(device)
    return ours.eval()


@dataclass
class _Row:
    """Requests laid out as a prefix tree in depth-first order: a token sees its ancestors."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # depth in the tree = position in its sequence
    parent: list[int] = field(default_factory=list)  # row index of the previous token, -1 at a root
    # Per scored request: (request index, row indices whose outputs predict it, its tokens).
    scored: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    def subtree_ends(self) -> list[int]:
        """For each token, one past the last row index of its subtree (depth-first order makes
        every subtree a contiguous run): token t sees s iff s <= t < end[s]."""
        end = [i + 1 for i in range(len(self.tokens))]
        for t in range(len(self.tokens) - 1, -1, -1):
            if self.parent[t] >= 0:
                end[self.parent[t]] = max(end[self.parent[t]], end[t])
        return end


def _window(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The model input lm-eval's `hf` model scores the continuation from: the last
    max_length + 1 tokens of context + continuation, minus the final one."""
    return (context + continuation)[-(max_length + 1) :][:-1]


def _rows(
    requests: list[tuple[list[int], list[int]]],
    max_length: int,
    row_tokens: int,
    span: float = float("inf"),
) -> list[_Row]:
    """Lay requests out as prefix trees: requests sharing a prefix (the choices of one item, the
    filler before a pass key) compute it once. Requests go in sorted order, so the longest
    shared prefix is always with the previous one; a request joins the current row while its
    new tokens cost less there than in a row of its own (attention grows with the row:
    cost(T) = T + T^2 / span, `span` = the row length where attention costs as much as the rest
    of the layer) and the row stays within `row_tokens`."""
    inputs = []
    for i, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"loglikelihood request {i} has an empty continuation")
        if len(continuation) > max_length:
            raise ValueError(
                f"loglikelihood request {i}: continuation of {len(continuation)} tokens exceeds the "
                f"model's {max_length}-token window; shorten the task's choices"
            )
        inputs.append(_window(context, continuation, max_length))

    def cost(t: int) -> float:
        return t + t * t / span

    rows: list[_Row] = []
    row, path, previous = None, [], []
    for i in sorted(range(len(requests)), key=lambda i: inputs[i]):
        seq = inputs[i]
        shared = 0
        if row is not None:
            limit = min(len(seq), len(previous))
            while shared < limit and seq[shared] == previous[shared]:
                shared += 1
            new = len(seq) - shared
            T = len(row.tokens)
            if T + new > row_tokens or cost(T + new) - cost(T) > cost(len(seq)):
                row, shared = None, 0
        if row is None:
            row, path = _Row(), []
            rows.append(row)
        path = path[:shared]
        for depth in range(shared, len(seq)):
            row.parent.append(path[-1] if path else -1)
            path.append(len(row.tokens))
            row.tokens.append(seq[depth])
            row.positions.append(depth)
        n = len(requests[i][1])
        row.scored.append((i, path[len(seq) - n :], requests[i][1]))
        previous = seq
    return rows


def _mask(ends: torch.Tensor) -> torch.Tensor:
    """(B, T) subtree ends (padding: its own index + 1) -> (B, 1, T, T) bool, True = query t may
    attend key s: s is t or an ancestor of t. Padding sees only itself (never all-masked)."""
    T = ends.shape[1]
    idx = torch.arange(T, device=ends.device)
    key, query = idx[None, None, :], idx[None, :, None]  # (1, 1, T), (1, T, 1)
    return ((key <= query) & (query < ends[:, None, :]))[:, None]  # (B, 1, T, T)


@torch.no_grad()
def score_requests(
    model: SmolLM3,
    requests: list[tuple[list[int], list[int]]],
    max_length: int,
    batch_tokens: int = 4096,
    on_batch: Callable[[dict[int, tuple[float, bool]]], None] | None = None,
) -> list[tuple[float, bool]]:
    """(log-probability of the continuation, whether it is the greedy continuation) for each
    (context tokens, continuation tokens) request, as lm-eval's `hf` model defines them. Rows
    hold up to max(batch_tokens, longest request) tokens; a batch up to batch_tokens padded
    tokens (or one row). `on_batch` receives each batch's answers by request index as soon as
    the batch is scored (a request lies in one row, so its answer is final then)."""
    device = model.embed.weight.device
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    logprob = torch.zeros(len(requests), dtype=torch.float64)
    misses = torch.zeros(len(requests), dtype=torch.int64)
    cfg = model.config
    # Per token and layer: the linears' multiply-adds against attention's 2 * T * hidden.
    span = (
        cfg.hidden_size * (2 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    ) / (2 * cfg.hidden_size)
    longest = max((min(len(c) + len(k), max_length + 1) - 1 for c, k in requests), default=0)
    rows = _rows(requests, max_length, max(batch_tokens, longest), span)
    rows.sort(key=lambda r: -len(r.tokens))
    start = 0
    while start < len(rows):
        # Longest first: the batch's first row sets its padded length.
        width = len(rows[start].tokens)
        batch = rows[start : start + max(1, batch_tokens // width)]
        start += len(batch)
        B = len(batch)
        ids = torch.zeros(B, width, dtype=torch.long)
        pos = torch.zeros(B, width, dtype=torch.long)
        ends = torch.arange(1, width + 1).repeat(B, 1)  # padding: itself only
        at_b, at_t, targets, owner = [], [], [], []
        for b, row in enumerate(batch):
            n = len(row.tokens)
            ids[b, :n] = torch.tensor(row.tokens)
            pos[b, :n] = torch.tensor(row.positions)
            ends[b, :n] = torch.tensor(row.subtree_ends())
            for i, where, tokens in row.scored:
                at_b += [b] * len(where)
                at_t += where
                targets += tokens
                owner += [i] * len(tokens)
        ids, pos, ends = ids.to(device), pos.to(device), ends.to(device)
        x = model.embed(ids)  # (B, T, H)
        cos, sin = rope_cos_sin(pos, model.inv_freq, x.dtype, model.rope_scale)  # (B, 1, T, hd) each
        mask = AttentionMask("dense", dense=_mask(ends))
        for block in model.layers:
            x = block(x, cos, sin, mask)  # (B, T, H)
        at = (torch.tensor(at_b, device=device), torch.tensor(at_t, device=device))
        h = model.norm(x)[at]  # (N, H): only the positions that predict a scored token
        logits = F.linear(h, head).float()  # (N, V), only where scored
        target = torch.tensor(targets, device=device)
        # log_softmax at the targets only: the (N, V) log-probabilities are never materialised.
        token_lp = (logits.gather(1, target[:, None])[:, 0] - logits.logsumexp(dim=-1)).double().cpu()
        missed = (logits.argmax(dim=-1) != target).long().cpu()  # (N,)
        who = torch.tensor(owner)
        logprob.index_add_(0, who, token_lp)
        misses.index_add_(0, who, missed)
        if on_batch is not None:
            done = [i for row in batch for i, _, _ in row.scored]
            on_batch({i: (logprob[i].item(), misses[i].item() == 0) for i in done})
    return [(lp, m == 0) for lp, m in zip(logprob.tolist(), misses.tolist(), strict=True)]


class PrefixSharingLM(HFLM):
    """lm-eval's `hf` model whose log-likelihood requests are scored once per shared prefix on
    our SmolLM3 (see the module docstring). `batch_tokens` bounds the padded tokens per forward.
    Requests whose window exceeds `dense_limit` tokens (long-context models) keep the `hf`
    scoring: its causal attention needs no (T, T) mask. `rope_scaling` (YaRN, model/config.py
    `RopeScaling`) reads the loaded model with it, in both scorings (model/hf.py
    `read_with_rope_scaling`); lm-eval's window is then its served length unless `max_length` says."""

    def __init__(
        self,
        pretrained: str,
        batch_tokens: int = 4096,
        dense_limit: int = 8192,
        progress: EvalProgress | None = None,
        rope_scaling: RopeScaling | None = None,
        **kwargs,
    ) -> None:
        if rope_scaling is not None:
            kwargs.setdefault("max_length", rope_scaling.max_positions)
        super().__init__(pretrained=pretrained, **kwargs)
        if rope_scaling is not None:
            from model.hf import read_with_rope_scaling

            read_with_rope_scaling(self.model, rope_scaling)
        if batch_tokens <= 0 or dense_limit <= 0:
            raise ValueError(f"batch_tokens and dense_limit must be > 0, got {batch_tokens}, {dense_limit}")
        self.batch_tokens, self.dense_limit = batch_tokens, dense_limit
        self.ours = smollm3_view(self.model)
        if progress is not None:
            self.set_cache_hook(progress)

    # Each request type announces its requests to a progress hook, then runs as lm-eval's `hf`.
    def _expect(self, kind: str, requests: list) -> None:
        if isinstance(self.cache_hook, EvalProgress):
            self.cache_hook.expect(kind, requests)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._expect("loglikelihood", requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        self._expect("loglikelihood_rolling", requests)
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        self._expect("generate_until", requests)
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self,
        requests: list[Request],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        if self.ours is None:  # not a SmolLM3 our model can run: the `hf` path, unchanged
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        # The model input of a request: its window (the last max_length + 1 tokens) minus one.
        short = [
            i
            for i, (_, ctx, cont) in enumerate(requests)
            if min(len(ctx) + len(cont), self.max_length + 1) - 1 <= self.dense_limit
        ]
        answers: list[tuple[float, bool] | None] = [None] * len(requests)

        def finished(batch: dict[int, tuple[float, bool]]) -> None:
            # Reported as each batch finishes, as the `hf` path reports each request.
            for j, answer in batch.items():
                key = requests[short[j]][0]
                if key is not None:  # rolling windows have no key: lm-eval caches those
                    self.cache_hook.add_partial("loglikelihood", key, answer)

        scored = score_requests(
            self.ours, [requests[i][1:] for i in short], self.max_length, self.batch_tokens, on_batch=finished
        )
        for i, answer in zip(short, scored, strict=True):
            answers[i] = answer
        rest = [i for i in range(len(requests)) if answers[i] is None]
        if rest:  # `hf` reports these to the cache itself
            stock = super()._loglikelihood_tokens([requests[i] for i in rest], disable_tqdm, override_bs)
            for i, answer in zip(rest, stock, strict=True):
                answers[i] = answer
        return answers


def _request_key(kind: str, args: Any) -> tuple:
    """What identifies a request in `add_partial`: (context, continuation) for log-likelihoods,
    the context for generations (their generation kwargs are a dict) and rolling windows."""
    return (kind, args[0], args[1]) if kind == "loglikelihood" else (kind, args[0])


class EvalProgress(CacheHook):
    """lm-eval's cache hook as a progress meter (caches nothing): items done per task, ETA.

    `expected` holds the items per task known before lm-eval starts (the suite's counts), so the
    percentage covers every request type from the start; tasks it does not name are counted
    when their requests are announced. An item is done when all its requests are answered."""

    def __init__(
        self,
        log: Callable[[str], None],
        report: Callable[[float], None] | None = None,
        expected: dict[str, int] | None = None,
        every_pct: float = 10.0,
        every_s: float = 30.0,
    ) -> None:
        super().__init__(None)
        self.items = dict(expected or {})  # task -> items to score
        self.done: Counter[str] = Counter()  # task -> items scored
        self._pending: dict[tuple, list[tuple[str, int]]] = defaultdict(list)  # request -> (task, doc)
        self._left: Counter[tuple[str, int]] = Counter()  # (task, doc) -> requests unanswered
        self._docs: dict[str, set[int]] = defaultdict(set)  # task -> documents announced
        self.meter = Progress(
            "lm-eval", sum(self.items.values()), "items", log, report, every_pct=every_pct, every_s=every_s
        )

    def expect(self, kind: str, requests: list) -> None:
        """The requests of one type, before lm-eval runs them (lm_eval Instances)."""
        for r in requests:
            item = (str(r.task_name), int(r.doc_id) if r.doc_id is not None else -1)
            self._pending[_request_key(kind, r.args)].append(item)
            self._left[item] += 1
            self._docs[item[0]].add(item[1])
        for task, docs in self._docs.items():
            self.items[task] = max(self.items.get(task, 0), len(docs))
        self.meter.total = sum(self.items.values())

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        waiting = self._pending.get(_request_key(attr, req))
        if not waiting:
            return  # not announced (a model without the hook's `expect`): nothing to count
        item = waiting.pop()
        self._left[item] -= 1
        if self._left[item] == 0:
            self.done[item[0]] += 1
            self.meter.advance(1, self._detail)

    def _detail(self) -> str:
        return ", ".join(f"{t} {self.done[t]}/{n}" for t, n in self.items.items())
