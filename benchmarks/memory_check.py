"""Predicted (model/memory.py) against measured peak memory of real training steps, on CPU.

    .venv/bin/python benchmarks/memory_check.py               # every section, a markdown table
    .venv/bin/python benchmarks/memory_check.py --only cpu    # or: fake3b, parallel

Each row is one optimizer step of this project's model, optimizer and loss, as the trainer runs
it (forward with document masking, chunked loss, backward, clipping, AdamW, zero_grad), after a
first step has created the AdamW state. Its peak is measured with torch's MemTracker
(`torch.distributed._tools.mem_tracker`: every tensor storage alive, parameters, gradients,
optimizer state and activations, as a dispatch mode sees them) and set against
`model.memory.estimate` for the same shape. Sections:
- cpu: real fp32 tensors, one plain rank, several model sizes, sequence lengths and every
  checkpointing mode;
- fake3b: the SmolLM3-3B shape under FakeTensorMode (shapes and dtypes, no data: 60-110 GB that
  this machine does not have), one rank, fp32;
- parallel: 4 gloo ranks under torchrun, FSDP2 (DP 4) and DP 2 x TP 2, rank 0's peak.
What none of them can measure is the GPU path (bf16 mixed precision, FlexAttention, the CUDA
allocator): benchmarks/gpu_check.py compares prediction and `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.config import ModelConfig  # noqa: E402
from model.memory import StepShape, estimate, measured_step_peak  # noqa: E402

CPU_CASES = (  # (ModelConfig.tiny overrides, micro-batch, sequence)
    (dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2), 2, 256),
    (dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2), 2, 512),
    (dict(vocab_size=4096, hidden_size=256, intermediate_size=800, num_layers=6, num_heads=4, num_kv_heads=2), 1, 1024),
    (
        dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=4, num_heads=6, num_kv_heads=2),
        1,
        2048,
    ),
)
FAKE_CASES = (("none", 4096, True), ("selective", 16384, True), ("full", 65536, False), ("none", 8192, False))
PARALLEL_MODEL = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2
)
PARALLEL_CASES = ((1, "none"), (2, "none"), (2, "selective"), (2, "full"))  # (tp, mode) on 4 ranks, seq 512, batch 2


def _batch(cfg: ModelConfig, b: int, t: int, doc_masking: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    docs = (torch.arange(t) * 3 // t).expand(b, t).contiguous() if doc_masking else None
    return ids, ids.roll(-1, 1), docs


def measure_one_rank(cfg: ModelConfig, b: int, t: int, mode: str, doc_masking: bool = True) -> int:
    from model.model import SmolLM3
    from model.optim import build_optimizer
    from model.spec import OptimizerConfig

    torch.manual_seed(0)
    model = SmolLM3(cfg)
    model.set_activation_checkpointing(mode)
    return measured_step_peak(model, build_optimizer(model, OptimizerConfig()), *_batch(cfg, b, t, doc_masking))


def measure_fake(cfg: ModelConfig, b: int, t: int, mode: str, doc_masking: bool) -> int:
    """The same step on fake tensors: shapes, dtypes and storages, no data and no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return measure_one_rank(cfg, b, t, mode, doc_masking)


def row(case: str, measured: float, est) -> dict:
    return {
        "case": case,
        "measured_mb": measured / 1e6,
        "predicted_mb": est.peak_bytes / 1e6,
        "error": est.peak_bytes / measured - 1,
        "phase": est.phase,
    }


def cpu_rows() -> list[dict]:
    out = []
    for overrides, b, t in CPU_CASES:
        cfg = ModelConfig.tiny(max_seq_len=t, **overrides)
        for mode in ("none", "selective", "full"):
            got = measure_one_rank(cfg, b, t, mode)
            est = estimate(StepShape(cfg, t, b, device="cpu", wrapped=False), mode)
            name = f"h{cfg.hidden_size} L{cfg.num_layers} V{cfg.vocab_size} b{b} s{t}, {mode}"
            out.append(row(name, got, est))
            print(_line(out[-1]), flush=True)
    return out


def fake3b_rows() -> list[dict]:
    out = []
    for mode, t, doc in FAKE_CASES:
        cfg = ModelConfig.smollm3_3b(max_seq_len=t)
        got = measure_fake(cfg, 1, t, mode, doc)
        est = estimate(StepShape(cfg, t, 1, device="cpu", wrapped=False, doc_masking=doc), mode)
        out.append(row(f"SmolLM3-3B b1 s{t}{'' if doc else ' causal'}, {mode} (fake tensors)", got, est))
        print(_line(out[-1]), flush=True)
    return out


def parallel_worker(tp: int, mode: str) -> None:
    """One rank of a 4-process gloo run (under torchrun): rank 0 prints `MEASURED <bytes> <shard>`."""
    import torch.distributed as dist

    from model.layout import plan_layout
    from model.model import SmolLM3
    from model.optim import build_optimizer
    from model.parallel import build_mesh, parallelize
    from model.spec import OptimizerConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = plan_layout(dist.get_world_size(), dist.get_world_size(), tp)
    cfg = ModelConfig.tiny(max_seq_len=512, **PARALLEL_MODEL)
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    model.set_activation_checkpointing(mode)
    parallelize(model, layout, build_mesh(layout, "cpu", True), torch.device("cpu"), "auto")
    batch = _batch(cfg, 2, 512, True, seed=layout.dp_rank(dist.get_rank()))
    peak = measured_step_peak(model, build_optimizer(model, OptimizerConfig()), *batch)
    if dist.get_rank() == 0:
        print(f"MEASURED {peak} {layout.shard}", flush=True)
    dist.destroy_process_group()


def parallel_rows() -> list[dict]:
    out = []
    torchrun = Path(sys.executable).with_name("torchrun")
    for tp, mode in PARALLEL_CASES:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(
            [str(torchrun), "--nproc-per-node", "4", "--master-port", str(port), __file__, "--worker", str(tp), mode],
            capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("MEASURED ")), None)
        if line is None:
            raise RuntimeError(f"parallel case tp {tp} {mode} failed:\n{proc.stderr[-3000:]}")
        got, shard = int(line.split()[1]), int(line.split()[2])
        cfg = ModelConfig.tiny(max_seq_len=512, **PARALLEL_MODEL)
        est = estimate(StepShape(cfg, 512, 2, tp=tp, shard=shard, device="cpu", wrapped=True), mode)
        name = f"h256 L4 V2048 b2 s512, {'DP 2 x TP 2' if tp == 2 else 'DP 4 (FSDP2)'}, {mode} (rank 0 of 4)"
        out.append(row(name, got, est))
        print(_line(out[-1]), flush=True)
    return out


def _line(r: dict) -> str:
    return f"| {r['case']} | {r['measured_mb']:,.1f} | {r['predicted_mb']:,.1f} | {100 * r['error']:+.1f}% | {r['phase']} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("cpu", "fake3b", "parallel"), default=None, help="one section")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one-rank sections")
    parser.add_argument("--worker", nargs=2, metavar=("TP", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        parallel_worker(int(args.worker[0]), args.worker[1])
        return 0
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| case | measured MB | predicted MB | error | peak phase |")
    print("|---|---|---|---|---|")
    started = time.perf_counter()
    rows = []
    for name, fn in (("cpu", cpu_rows), ("fake3b", fake3b_rows), ("parallel", parallel_rows)):
        if args.only in (None, name):
            rows += fn()
    worst = max(abs(r["error"]) for r in rows)
    print(f"{len(rows)} cases, worst error {100 * worst:.1f}%, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
