"""The step engine: steps as data, the graph, the runner, the dry run, slots, run owners,
the workspace and its lineage. It imports nothing of the application (tasks, flows, model).
"""
