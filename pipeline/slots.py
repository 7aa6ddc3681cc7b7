"""Named resource slots: how many heavy steps of each kind run at once, and with how many threads.

Independent steps run concurrently; slots keep them from oversubscribing the machine. The recipe's
`resources` section sizes three slots:

    train: training stages and post-training trainers (a GPU node's worth, or some CPU cores)
    eval:  exports and evaluations (lm-eval, held-out loss)
    data:  source reading, curation, tokenizer training and tokenization

A slot is `slots` lock files under `{workspace}/.slots/`; a step holds one (`fcntl.flock`) while
its build runs. The locks are shared by every process using the workspace (a served `smollm3/full`
run and an anneal started beside it) and are released by the kernel when a holder dies, so a
crashed run never leaks a slot. `threads` is the CPU thread count a step gets inside its slot
(torch/OpenMP, tokenizers, datatrove): on the tiny recipe's 2 cores, one training stage and one
evaluation run side by side with one thread each.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.artifact import operational


class SlotConfig(BaseModel):
    """One resource kind: how many steps hold it at once, and the CPU threads each gets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slots: int = operational(1, gt=0)  # steps of this kind running at once
    threads: int | None = operational(None, gt=0)  # CPU threads per step; None: cores / slots


class ResourcesConfig(BaseModel):
    """The recipe's `resources` section. Every field is operational: it changes when and how fast
    steps run, never what they compute, so it never enters a fingerprint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: SlotConfig = operational(SlotConfig())  # training stages, post-training trainers, preflight
    eval: SlotConfig = operational(SlotConfig())  # HF exports, lm-eval, held-out loss
    data: SlotConfig = operational(SlotConfig(slots=2))  # sources, curation, tokenizers, tokenization
    poll_seconds: float = operational(0.5, ge=0.01)  # how often a waiting step retries its slot (a floor)

    def threads(self, name: str) -> int:
        """Threads per step of slot `name`: the recipe's number, else the cores split evenly."""
        slot: SlotConfig = getattr(self, name)
        return slot.threads or max(1, (os.cpu_count() or 1) // slot.slots)


@contextmanager
def hold(
    folder: Path,
    name: str,
    slots: int,
    *,
    poll: float = 0.5,
    log: Callable[[str], None] = print,
    who: str = "",
) -> Iterator[int]:
    """Hold one of `slots` slots named `name` (blocks until one is free); yields its index."""
    folder.mkdir(parents=True, exist_ok=True)
    handles = []
    waited, announced = time.monotonic(), False
    try:
        while True:
            for i in range(slots):
                fh = open(folder / f"{name}.{i}.lock", "a+")
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.close()
                    continue
                handles.append(fh)
                if announced:
                    log(f"{who} got {name} slot {i} after {time.monotonic() - waited:.1f} s")
                yield i
                return
            if not announced:
                log(f"{who} waits for a {name} slot ({slots} busy)")
                announced = True
            time.sleep(poll)
    finally:
        for fh in handles:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()
