"""Post-training: SFT, preference optimisation (APO), merging, GRPO, SAO and on-policy distillation.

One module per step (data, sft, preference, merge, grpo, sao, distill), each step a `@step`
function; trainers/posttrain/sections.py holds the recipe's `posttrain` section. See
docs/posttraining.md for the order, the defaults and how to run them at real sizes.
"""
