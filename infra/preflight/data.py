"""Data and evaluation checks: shards exist and hold enough tokens for each stage, the tokenizer
fits the model's embedding, and the evaluation tasks resolve.

Token counts of datatrove shards come from each `.ds.metadata` (tokenizer|token_size, then the
count) when present, else from the `.ds` size and the token width the vocabulary implies (uint16
below 65536 entries, uint32 above), the same rule datatrove's DocumentTokenizer applies.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from infra.preflight.core import Check, CheckContext, CheckResult, register


def human_tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def shard_tokens(path: Path, vocab: int) -> int:
    """Tokens in one `.ds` file."""
    meta = path.with_name(path.name + ".metadata")
    if meta.is_file():
        lines = meta.read_text(encoding="utf-8").splitlines()
        if len(lines) >= 2 and lines[1].strip().lstrip("-").isdigit() and int(lines[1]) >= 0:
            return int(lines[1])
        if lines and "|" in lines[0]:
            return path.stat().st_size // int(lines[0].rsplit("|", 1)[1])
    width = 4 if vocab > 65535 else 2
    return path.stat().st_size // width


@register
class Shards(Check):
    """The recipe's tokenized shard folders exist and hold tokens."""

    name, group, order = "shards", "data", 80

    def run(self, ctx: CheckContext) -> CheckResult:
        folders = [Path(s).expanduser() for s in ctx.facts.shards]
        if not folders:
            return self.skip("facts list no shard folders (tokenize first, or pass them)")
        missing, empty, total, files = [], [], 0, 0
        for folder in folders:
            if not folder.is_dir():
                missing.append(str(folder))
                continue
            ds = sorted(folder.rglob("*.ds"))
            tokens = sum(shard_tokens(p, ctx.facts.tokenizer_vocab) for p in ds)
            if not tokens:
                empty.append(str(folder))
            total += tokens
            files += len(ds)
        ctx.memo["shard_tokens"] = total
        value = f"{human_tokens(total)} tokens in {files} .ds files, {len(folders)} folders"
        if missing or empty:
            problems = [f"missing: {', '.join(missing)}"] if missing else []
            problems += [f"no tokens: {', '.join(empty)}"] if empty else []
            return self.result("fail", value, "every folder holds .ds tokens",
                               f"{'; '.join(problems)}: run the tokenize step or fix the paths",
                               metric=total)
        return self.result("pass", value, "every folder holds .ds tokens", metric=total)


@register
class DataEpochs(Check):
    """Tokens each stage trains on against the unique tokens its data offers (epochs)."""

    name, group, order = "data_epochs", "data", 81

    def run(self, ctx: CheckContext) -> CheckResult:
        f, c = ctx.facts, ctx.config
        if not f.stage_tokens:
            return self.skip("facts give no stage_tokens")
        fallback = ctx.memo.get("shard_tokens")
        epochs: dict[str, float] = {}
        for stage, need in f.stage_tokens.items():
            have = f.available_tokens.get(stage, fallback)
            if have is None:
                continue
            epochs[stage] = need / have if have else float("inf")
        if not epochs:
            return self.skip("facts give no available_tokens and no shards to count")
        worst = max(epochs.values())
        value = ", ".join(f"{s}: {e:.2f} epochs" for s, e in epochs.items())
        threshold = f"<= 1 epoch (warn up to {c.max_epochs:g})"
        over = [s for s, e in epochs.items() if e > 1]
        if worst > c.max_epochs:
            return self.result(
                "fail", value, threshold,
                f"stage(s) {', '.join(over)} repeat their data more than {c.max_epochs:g} times: "
                "add data, lower the stage's tokens, or reweight the mixture",
                metric=worst,
            )
        if over:
            return self.result(
                "warn", value, threshold,
                f"stage(s) {', '.join(over)} repeat data; up to ~4 epochs costs little, beyond "
                "that returns fall fast",
                metric=worst,
            )
        return self.result("pass", value, threshold, metric=worst)


@register
class Vocab(Check):
    """Every token id the tokenizer emits has a row in the model's embedding."""

    name, group, order = "vocab", "data", 82

    def run(self, ctx: CheckContext) -> CheckResult:
        tok, model = ctx.facts.tokenizer_vocab, ctx.facts.model_vocab
        if not tok or not model:
            return self.skip("facts give no tokenizer_vocab or model_vocab")
        value = f"tokenizer {tok}, model {model}"
        if tok > model:
            return self.result(
                "fail", value, "tokenizer <= model",
                f"token ids {model}..{tok - 1} have no embedding row (index error mid-run): "
                f"set the model's vocab_size to at least {tok} (a multiple of 128 is fastest)",
            )
        return self.result("pass", value, "tokenizer <= model")


TASK_LINE = re.compile(r"^\s*(?:task|group|tag)\s*:\s*['\"]?([\w.\-]+)['\"]?\s*$")


def local_task_names(folder: Path) -> set[str]:
    """Task (and group/tag) names declared by the YAML files of a local lm-eval task folder."""
    names: set[str] = set()
    for path in sorted(folder.rglob("*.yaml")) + sorted(folder.rglob("*.yml")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            m = TASK_LINE.match(line)
            if m:
                names.add(m.group(1))
    return names


@register
class EvalTasks(Check):
    """Evaluation task names resolve: in the local task folder, else through lm-eval."""

    name, group, order = "eval_tasks", "data", 83

    def run(self, ctx: CheckContext) -> CheckResult:
        f, c = ctx.facts, ctx.config
        if not f.eval_tasks:
            return self.skip("facts give no eval_tasks")
        known: set[str] = set()
        folder = Path(c.eval_tasks_dir).expanduser() if c.eval_tasks_dir else None
        if folder is not None:
            if not folder.is_dir():
                return self.result("fail", "", "", f"eval_tasks_dir {folder} does not exist")
            known |= local_task_names(folder)
        wanted = list(f.eval_tasks)
        unresolved = [t for t in wanted if t not in known]
        source = "local"
        if unresolved and c.eval_lm_eval_lookup:
            try:
                from lm_eval.tasks import TaskManager
            except ImportError:
                return self.result("warn", "", "", "lm-eval is not installed; cannot resolve "
                                   f"{', '.join(unresolved)} (pip install lm-eval)")
            manager = TaskManager(include_path=str(folder) if folder else None)
            known |= set(manager.all_tasks)
            unresolved = [t for t in wanted if t not in known]
            source = "local + lm-eval" if folder else "lm-eval"
        value = f"{len(wanted) - len(unresolved)}/{len(wanted)} tasks resolve ({source})"
        if unresolved:
            hints = []
            for t in unresolved:
                close = difflib.get_close_matches(t, sorted(known), n=2)
                hints.append(f"{t}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
            return self.result("fail", value, "every task resolves",
                               f"unknown eval task(s): {'; '.join(hints)}")
        return self.result("pass", value, "every task resolves")
