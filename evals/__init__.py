"""Evaluation libraries: the lm-eval model, the quality criteria of eval tasks, experiment statistics."""
