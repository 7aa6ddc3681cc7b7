"""Config review: the recipe's batch layout, sequence length and stage plan add up.

These run first and take microseconds; they catch the launch-script mistakes the playbook lists
(a global batch the ranks cannot split, a sequence longer than the position table, an empty stage).
"""

from __future__ import annotations

from infra.preflight.core import Check, CheckContext, CheckResult, register
from infra.preflight.data import human_tokens


@register
class BatchLayout(Check):
    """Global batch = data-parallel ranks x micro-batch x gradient-accumulation steps."""

    name, group, order = "batch_layout", "config", 1

    def run(self, ctx: CheckContext) -> CheckResult:
        f = ctx.facts
        if not f.global_batch or not f.micro_batch:
            return self.skip("facts give no global_batch and micro_batch")
        world, model_parallel = f.world_size, f.tp * f.pp
        if world % model_parallel:
            return self.result(
                "fail",
                f"world {world}, tp {f.tp} x pp {f.pp}",
                "world % (tp x pp) == 0",
                f"world size {world} (nodes {f.nodes} x nproc_per_node {f.nproc_per_node}) is not "
                f"a multiple of tp x pp = {model_parallel}",
            )
        dp = world // model_parallel
        unit = dp * f.micro_batch
        threshold = f"global_batch % (dp {dp} x micro_batch {f.micro_batch}) == 0"
        if f.global_batch % unit:
            lower = f.global_batch // unit * unit
            options = " or ".join(str(x) for x in (lower, lower + unit) if x > 0)
            return self.result(
                "fail",
                f"global_batch {f.global_batch}",
                threshold,
                f"global_batch {f.global_batch} is not a multiple of {unit}: use {options}, or "
                "change micro_batch / the number of ranks",
            )
        accum = f.global_batch // unit
        value = f"{f.global_batch} = dp {dp} x micro {f.micro_batch} x accum {accum}"
        if f.seq_len:
            value += f" ({human_tokens(f.global_batch * f.seq_len)} tokens/step)"
        return self.result("pass", value, threshold, metric=accum)


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
