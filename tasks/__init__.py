"""Pipeline steps: one module per step, pure helpers plus one thin Prefect task each."""
