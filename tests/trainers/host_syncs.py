"""Run the trainer counting its host synchronisations, injected from outside (the test's own
patches, not the trainer's code): `Tensor.item`, `Tensor.tolist`, `torch.cuda.synchronize` and
`torch.distributed.all_gather`. Each call is recorded with the loop's step (the `step` local of
trainers/pretrain.py `_train`) and whether it came from inside `train_step`.

`python host_syncs.py SPEC.json OUT` (alone or under torchrun) trains like `python -m
trainers.pretrain SPEC.json` and writes `OUT.{rank}`: a JSON list of [what, step, in_step, caller].
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

CALLS: list[list] = []


def _where() -> tuple[bool, int | None, str]:
    frame = sys._getframe(2)
    caller = f"{frame.f_code.co_filename.split('site-packages/')[-1]}:{frame.f_code.co_name}"
    in_step = False
    while frame is not None:
        if frame.f_code.co_filename.endswith("trainers/pretrain.py"):
            if frame.f_code.co_name == "train_step":
                in_step = True
            if frame.f_code.co_name == "_train":
                return in_step, frame.f_locals.get("step"), caller
        frame = frame.f_back
    return in_step, None, caller


def _counting(what: str, fn):
    def counted(*args, **kwargs):
        in_step, step, caller = _where()
        if step is not None:  # inside the training loop's launch (after the build)
            CALLS.append([what, step, in_step, caller])
        return fn(*args, **kwargs)

    return counted


def main() -> int:
    spec, out = sys.argv[1], sys.argv[2]
    torch.Tensor.item = _counting("item", torch.Tensor.item)
    torch.Tensor.tolist = _counting("tolist", torch.Tensor.tolist)
    torch.cuda.synchronize = _counting("synchronize", torch.cuda.synchronize)
    dist.all_gather = _counting("all_gather", dist.all_gather)
    from trainers.pretrain import main as train

    code = train([spec])
    with open(f"{out}.{os.environ.get('RANK', '0')}", "w") as fh:
        json.dump(CALLS, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
