"""Config review: the recipe's batch layout, sequence length and stage plan add up.

These run first and take microseconds; they catch the launch-script mistakes the playbook lists
(a global batch the ranks cannot split, a sequence longer than the position table, an empty stage).
"""

from __future__ import annotations

from infra.preflight.core import Check, CheckContext, CheckResult, register
from infra.preflight.data import human_tokens


@register
class BatchLayout(Check):
    """Global batch = data-parallel ranks x micro-batch x gradient-accumulation steps, where the
    data-parallel size is world / (tp x cp x pp): the ranks of one TP x CP block read the same
    sequences (model/parallel.py). Checked for the training layout and each stage's own (the 3B
    recipe's long-context stages: 12 nodes x 8, TP 2 x CP 4, DP 12, micro 1, accumulation 6)."""

    name, group, order = "batch_layout", "config", 1

    def run(self, ctx: CheckContext) -> CheckResult:
        f = ctx.facts
        if not f.global_batch or not f.micro_batch:
            return self.skip("facts give no global_batch and micro_batch")
        values, accums = [], []
        for stage, layout in f.layouts().items():
            failed, value, accum = self._one(f, stage, **layout)
            if failed is not None:
                return failed
            values.append(value)
            accums.append(accum)
        threshold = "global_batch % (dp x micro_batch) == 0, dp = world / (tp x cp x pp)"
        return self.result("pass", "; ".join(values), threshold, metric=accums[0])

    def _one(self, f, stage: str, nodes: int, tp: int, cp: int, micro_batch: int, global_batch: int):
        """(a fail result or None, the pass value, the accumulation) of one layout."""
        where = f"stage {stage}: " if stage else ""
        world, model_parallel = nodes * f.nproc_per_node, tp * cp * f.pp
        if world % model_parallel:
            return (
                self.result(
                    "fail",
                    f"{where}world {world}, tp {tp} x cp {cp} x pp {f.pp}",
                    "world % (tp x cp x pp) == 0",
                    f"{where}world size {world} (nodes {nodes} x nproc_per_node {f.nproc_per_node}) is not "
                    f"a multiple of tp x cp x pp = {model_parallel}",
                ),
                "",
                0,
            )
        dp = world // model_parallel
        unit = dp * micro_batch
        if global_batch % unit:
            lower = global_batch // unit * unit
            options = " or ".join(str(x) for x in (lower, lower + unit) if x > 0)
            return (
                self.result(
                    "fail",
                    f"{where}global_batch {global_batch}",
                    f"global_batch % (dp {dp} x micro_batch {micro_batch}) == 0",
                    f"{where}global_batch {global_batch} is not a multiple of {unit} (dp {dp} = world {world} / "
                    f"(tp {tp} x cp {cp} x pp {f.pp}) x micro_batch {micro_batch}): use {options}, or "
                    "change micro_batch / the number of ranks",
                ),
                "",
                0,
            )
        accum = global_batch // unit
        value = f"{where}{global_batch} = dp {dp} x micro {micro_batch} x accum {accum}"
        if cp > 1:
            value += f" (tp {tp} x cp {cp})"
        seq_len = f.stage_seq_len.get(stage, f.seq_len) if stage else f.seq_len
        if seq_len:
            value += f" ({human_tokens(global_batch * seq_len)} tokens/step)"
        return None, value, accum


@register
class SeqLen(Check):
    """The training sequence fits the model's position table."""

    name, group, order = "seq_len", "config", 2

    def run(self, ctx: CheckContext) -> CheckResult:
        f = ctx.facts
        if not f.seq_len or not f.max_positions:
            return self.skip("facts give no seq_len and max_positions")
        value, threshold = f"seq_len {f.seq_len}", f"<= max_positions {f.max_positions}"
        if f.seq_len > f.max_positions:
            return self.result(
                "fail",
                value,
                threshold,
                f"seq_len {f.seq_len} exceeds the model's max_position_embeddings "
                f"{f.max_positions}: raise training.model_overrides.max_seq_len (and the stage's "
                "rope_theta; facts.max_positions by hand) or shorten stages[].seq_len",
            )
        return self.result("pass", value, threshold)


@register
class StagePlan(Check):
    """Every stage trains on a positive number of tokens, at least one optimizer step."""

    name, group, order = "stage_plan", "config", 3

    def run(self, ctx: CheckContext) -> CheckResult:
        f = ctx.facts
        if not f.stage_tokens:
            return self.skip("facts give no stage_tokens")
        threshold = "tokens > 0 and >= 1 step per stage"
        bad = [s for s, t in f.stage_tokens.items() if t <= 0]
        if bad:
            return self.result("fail", "", threshold, f"stage(s) {', '.join(bad)} train on no tokens: set their tokens")
        strays = sorted(set(f.available_tokens) - set(f.stage_tokens))
        if strays:
            return self.result(
                "fail",
                "",
                threshold,
                f"available_tokens names stage(s) {', '.join(strays)} that stage_tokens lacks; "
                f"stages: {', '.join(f.stage_tokens)}",
            )
        total = sum(f.stage_tokens.values())
        value = f"{len(f.stage_tokens)} stages, {human_tokens(total)} tokens"

        def per_step(stage: str) -> int:
            return f.global_batch * f.stage_seq_len.get(stage, f.seq_len)

        if all(per_step(s) for s in f.stage_tokens):
            steps = {s: t / per_step(s) for s, t in f.stage_tokens.items()}
            short = [s for s, n in steps.items() if n < 1]
            value += f", {human_tokens(sum(steps.values()))} steps"
            if short:
                return self.result(
                    "fail",
                    value,
                    threshold,
                    f"stage(s) {', '.join(short)} are shorter than one optimizer step "
                    f"({', '.join(f'{s}: {human_tokens(per_step(s))} tokens' for s in short)})",
                )
        return self.result("pass", value, threshold, metric=total)
