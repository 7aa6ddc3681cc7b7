"""Prefect flows: DAG wiring and deployments only; the work lives in `tasks/`."""
