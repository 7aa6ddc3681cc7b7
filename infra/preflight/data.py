"""Data and evaluation checks: shards exist and hold enough tokens for each stage, the tokenizer
fits the model's embedding, and the evaluation tasks resolve.

Token counts of datatrove shards come from each `.ds.metadata` (tokenizer|token_size, then the
count) when present, else from the `.ds` size and the token width the vocabulary implies (uint16
below 65536 entries, uint32 above), the same rule datatrove's DocumentTokenizer applies.

Mixture plans (`plan.json` of the mixture step: stage, tokens, vocab_size and per source its files,
available and budget tokens and expected epochs) sharpen both: their files must exist, and a
stage's epochs are its most repeated source's, since one source can repeat 10x inside a stage
whose total data looks plentiful.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from infra.files import path_from_file
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


def load_plans(paths: tuple[str, ...]) -> list[dict]:
    """The mixture plans named in the facts; a missing or malformed one is an error naming it."""
    plans = []
    for path in paths:
        file = Path(path).expanduser()
        try:
            plan = json.loads(file.read_text(encoding="utf-8"))
            plan["stage"], plan["sources"]  # noqa: B018  (the fields every check relies on)
            for source in plan["sources"]:  # shards recorded relative to the plan (./, ../)
                source["files"] = [path_from_file(f, file) for f in source.get("files", ())]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"mixture plan {file} is unreadable ({type(exc).__name__}: {exc}); "
                "rerun the mixture step or fix facts.mixture_plans"
            ) from None
        plans.append(plan)
    return plans


@register
class Shards(Check):
    """The recipe's tokenized shard folders exist and hold tokens."""

    name, group, order = "shards", "data", 80

    def run(self, ctx: CheckContext) -> CheckResult:
        folders = [Path(s).expanduser() for s in ctx.facts.shards]
        try:
            plans = load_plans(ctx.facts.mixture_plans)
        except ValueError as exc:
            return self.result("fail", "", "", str(exc))
        planned = sorted({f for p in plans for s in p["sources"] for f in s.get("files", ())})
        if not folders and not planned:
            return self.skip("facts list no shard folders or mixture plans (tokenize first)")
        missing, empty, total, files = [], [], 0, 0
        missing += [f for f in planned if not Path(f).is_file()]
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
        parts = []
        if folders:
            ctx.memo["shard_tokens"] = total
            parts.append(f"{human_tokens(total)} tokens in {files} .ds files, {len(folders)} folders")
        if planned:
            present = sum(Path(f).is_file() for f in planned)
            parts.append(f"{present}/{len(planned)} planned files present ({len(plans)} plans)")
        value = "; ".join(parts)
        if missing or empty:
            problems = [f"missing: {', '.join(missing)}"] if missing else []
            problems += [f"no tokens: {', '.join(empty)}"] if empty else []
            return self.result(
                "fail",
                value,
                "every folder holds .ds tokens",
                f"{'; '.join(problems)[:600]}: run the tokenize step or fix the paths",
                metric=total,
            )
        return self.result("pass", value, "every folder holds .ds tokens", metric=total)


@register
class DataEpochs(Check):
    """Tokens each stage trains on against the unique tokens its data offers (epochs)."""

    name, group, order = "data_epochs", "data", 81

    def run(self, ctx: CheckContext) -> CheckResult:
        f, c = ctx.facts, ctx.config
        plans = load_plans(f.mixture_plans)
        if not f.stage_tokens and not plans:
            return self.skip("facts give no stage_tokens and no mixture_plans")
        fallback = ctx.memo.get("shard_tokens")
        epochs: dict[str, float] = {}
        label: dict[str, str] = {}
        for stage, need in f.stage_tokens.items():
            have = f.available_tokens.get(stage, fallback)
            if have is None:
                continue
            epochs[stage] = need / have if have else float("inf")
        for plan in plans:  # per source: the most repeated source sets the stage's figure
            for src in plan["sources"]:
                e = float(src.get("expected_epochs", 0.0))
                stage = str(plan["stage"])
                if e > epochs.get(stage, -1.0):
                    epochs[stage], label[stage] = e, f" ({src.get('name', '?')})"
        if not epochs:
            return self.skip("facts give no available_tokens, shards or mixture_plans to count")
        worst = max(epochs.values())
        value = ", ".join(f"{s}: {e:.2f} epochs{label.get(s, '')}" for s, e in epochs.items())
        # A stage whose recipe accepts more repeats (reasoning mid-training: 4-5 epochs) is held to that.
        limit = {s: max(c.max_epochs, f.stage_max_epochs.get(s, 0.0)) for s in epochs}
        own = {s: v for s, v in limit.items() if v > c.max_epochs}
        threshold = f"<= 1 epoch (warn up to {c.max_epochs:g}" + "".join(f", {s} {v:g}" for s, v in own.items()) + ")"
        over = [s for s, e in epochs.items() if e > 1]
        too_many = [s for s, e in epochs.items() if e > limit[s]]
        if too_many:
            return self.result(
                "fail",
                value,
                threshold,
                f"stage(s) {', '.join(too_many)} repeat their data more than "
                + ", ".join(f"{limit[s]:g}" for s in too_many)
                + " times: add data, lower the stage's tokens, or reweight the mixture",
                metric=worst,
            )
        if over:
            return self.result(
                "warn",
                value,
                threshold,
                f"stage(s) {', '.join(over)} repeat data; up to ~4 epochs costs little, beyond that returns fall fast",
                metric=worst,
            )
        return self.result("pass", value, threshold, metric=worst)


@register
class Vocab(Check):
    """Every token id the tokenizer emits has a row in the model's embedding."""

    name, group, order = "vocab", "data", 82

    def run(self, ctx: CheckContext) -> CheckResult:
        tok, model = ctx.facts.tokenizer_vocab, ctx.facts.model_vocab
        if not tok and ctx.facts.mixture_plans:  # the shards' tokenizer, as the plans record it
            tok = max((int(p.get("vocab_size") or 0) for p in load_plans(ctx.facts.mixture_plans)), default=0)
        if not tok or not model:
            return self.skip("facts give no tokenizer_vocab or model_vocab")
        value = f"tokenizer {tok}, model {model}"
        if tok > model:
            return self.result(
                "fail",
                value,
                "tokenizer <= model",
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
                return self.result(
                    "warn",
                    "",
                    "",
                    f"lm-eval is not installed; cannot resolve {', '.join(unresolved)} (pip install lm-eval)",
                )
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
            return self.result("fail", value, "every task resolves", f"unknown eval task(s): {'; '.join(hints)}")
        return self.result("pass", value, "every task resolves")
