"""The eval suite's tasks, one module per task (nanochat's `tasks/arc.py` layout): each defines an
`EvalTask` (evals/benchmarks/eval_task.py) that builds its items and writes its lm-eval task file;
evals/suite.py `TASKS` registers them, one line each, and builds the suite from that list.

Named `benchmarks`, not `tasks`, so that `tasks` stays the name of the step package."""
