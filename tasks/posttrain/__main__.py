"""Run one post-training step's trainer outside Prefect, e.g. on every GPU of a node:

    accelerate launch --num_processes 8 -m tasks.posttrain sft spec.json

`spec.json` holds {"config": {...the recipe's posttrain.<step> section...}, "policy": HF folder,
"data": posttrain data folder, "out": output folder, "seed": 0}. TRL's trainers pick up the
accelerate/torchrun environment (DDP, FSDP or DeepSpeed per the accelerate config); only the main
process writes the model folder. The Prefect steps call the same functions in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.posttrain import config as sections

TRAINERS = {
    "sft": ("tasks.posttrain.sft", "train_sft", sections.SFTSection),
    "preference": ("tasks.posttrain.preference", "train_preference", sections.PreferenceSection),
    "grpo": ("tasks.posttrain.grpo", "train_grpo", sections.GRPOSection),
    "distill": ("tasks.posttrain.distill", "train_distill", sections.DistillSection),
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in TRAINERS:
        print(f"usage: python -m tasks.posttrain {{{','.join(TRAINERS)}}} spec.json", file=sys.stderr)
        return 2
    import importlib

    module, fn, section = TRAINERS[argv[0]]
    spec = json.loads(Path(argv[1]).read_text())
    missing = [k for k in ("config", "policy", "data", "out") if k not in spec]
    if missing:
        print(f"{argv[1]}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    train = getattr(importlib.import_module(module), fn)
    meta = train(section(**spec["config"]), Path(spec["policy"]), Path(spec["data"]), Path(spec["out"]),
                 seed=spec.get("seed", 0), device=spec.get("device", "auto"))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
