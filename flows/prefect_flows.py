"""The Prefect flows: each flow module's function as the Prefect flow of its name.

`smollm3 run`, `smollm3 ablate`, the deployments (prefect.yaml entrypoints
`flows/prefect_flows.py:<name>`), the demo and the UI run these. Importing this module imports
Prefect; planning and the CLI's light commands import the flow modules (their `graph()`), never
this one.
"""

from __future__ import annotations

from flows.ablation import run_ablation
from flows.anneal import run_anneal
from flows.cpt import run_cpt
from flows.smollm3 import run_smollm3
from pipeline.graph import prefect_flow

smollm3 = prefect_flow("smollm3", run_smollm3, __name__)  # the whole DAG from a recipe (flows/smollm3.py)
anneal = prefect_flow("anneal", run_anneal, __name__)  # anneal candidates from the newest run's base (flows/anneal.py)
cpt = prefect_flow("cpt", run_cpt, __name__, max_workers=64)  # continued pretraining from a base (flows/cpt.py)
ablation = prefect_flow("ablation", run_ablation, __name__)  # variants of a recipe side by side (flows/ablation.py)
