"""The torch side of smollm3-pipeline: SmolLM3 decoder, token-shard loader, trainer, checkpoints.

Never imports Prefect, flows, tasks or infra; the orchestration layer crosses into this package
through `python -m trainers.pretrain SPEC.json` (under torchrun) and `model.hf.export_hf`.
"""
