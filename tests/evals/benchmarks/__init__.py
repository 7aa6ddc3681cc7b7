"""Tests of the eval suite's tasks (evals/benchmarks/), one file per task module."""
