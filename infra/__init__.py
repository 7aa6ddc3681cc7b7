"""Infrastructure shared by every step: workspace, artifacts, lineage, subprocesses.

Never imports `flows` or `tasks` (dependencies flow one way: flows -> tasks -> model, infra).
"""
