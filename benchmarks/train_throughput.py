"""Training throughput of our SmolLM3 against transformers' SmolLM3ForCausalLM.

Both models get the same shape, the same batch and the same targets (T per row: transformers
gets them as `shift_labels`, so it does not shift and drop one), fp32, AdamW (foreach) with grad
clipping, and run interleaved in one process so machine noise hits both alike. transformers
trains with `use_cache=False`: its default builds a KV cache on every training forward. Prints tokens/s of each,
their ratio, and achieved FLOP/s as a fraction of this machine's measured fp32 matmul rate.

    .venv/bin/python benchmarks/train_throughput.py            # 8.35M params, seq 256, batch 8
    .venv/bin/python benchmarks/train_throughput.py --rounds 3 --threads 2

Baseline named by the project: on 2 CPU cores transformers reaches about 2,400 tokens/s at
8.4M parameters (seq 256, batch 8); ours must not be slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig  # noqa: E402
from model.flops import measure_matmul_flops, training_flops_per_token  # noqa: E402
from model.hf import to_hf_model  # noqa: E402
from model.model import SmolLM3  # noqa: E402
from model.optim import build_optimizer  # noqa: E402
from model.spec import OptimizerConfig  # noqa: E402


def make_step(model, optimizer, forward):
    params = list(model.parameters())

    def step(ids, labels, doc_ids):
        loss = forward(model, ids, labels, doc_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def ours_forward(model, ids, labels, doc_ids):
    return model(ids, doc_ids, labels=labels).loss


def hf_forward(model, ids, labels, doc_ids):
    # shift_labels: the targets as given (HF would otherwise shift `labels` and train on T - 1).
    return model(input_ids=ids, labels=labels, shift_labels=labels, use_cache=False).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = ModelConfig.tiny(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=800,
        num_layers=9,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=args.seq_len,
    )
    opt_spec = OptimizerConfig(lr=3e-4)
    torch.manual_seed(0)
    ours = SmolLM3(cfg).train()
    hf = to_hf_model(SmolLM3(cfg)).train()  # same shape and init statistics
    T, B = args.seq_len, args.batch
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    # Packed rows of 4 documents each: the intra-document masking path (dense mask on CPU).
    doc_ids = (torch.arange(T) * 4 // T).expand(B, T).contiguous()

    def deterministic(step):
        """trainers.pretrain on CPU turns deterministic algorithms on (bit-exact resume)."""

        def wrapped(*args):
            torch.use_deterministic_algorithms(True)
            try:
                return step(*args)
            finally:
                torch.use_deterministic_algorithms(False)

        return wrapped

    ours_step = make_step(ours, build_optimizer(ours, opt_spec), ours_forward)
    variants = {
        "ours": (ours_step, inputs, targets, None),
        "transformers": (
            make_step(hf, build_optimizer(hf, opt_spec), hf_forward),
            inputs,
            targets,
            None,
        ),
        "ours, doc masking": (ours_step, inputs, targets, doc_ids),
        "ours, doc masking + deterministic": (deterministic(ours_step), inputs, targets, doc_ids),
    }
    for step, x, y, d in variants.values():  # warm-up: allocator, thread pools
        for _ in range(2):
            step(x, y, d)
    # Alternate single steps so that load from other processes hits every variant alike; the
    # best step estimates the uncontended speed, the median the typical one. CPU time of this
    # process is recorded too: on a shared machine it is far steadier than wall time, since it
    # does not count the time other processes hold the cores.
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds * args.steps):
        for name, (step, x, y, d) in variants.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(x, y, d)
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)

    peak = measure_matmul_flops("cpu", torch.float32, size=1024, seconds=2.0)
    cpu_peak = cpu_time_matmul_flops(args.threads)
    flops_per_token = training_flops_per_token(cfg, T)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"model: {cfg.num_parameters():,} parameters, seq {T}, batch {B}, "
        f"{args.threads} threads, fp32, AdamW; load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"fp32 1024^2 matmul peak, {args.threads} threads: best wall burst {peak / 1e9:.1f} "
        f"GFLOP/s, per CPU time x threads {cpu_peak / 1e9:.1f} GFLOP/s"
    )
    print(f"{'variant':38s} {'best tok/s':>10s} {'median':>8s} {'cpu tok/s':>10s} {'GFLOP/s':>8s} {'of peak':>8s}")
    best, median, per_cpu = {}, {}, {}
    for name, values in seconds.items():
        best[name] = B * T / min(values)
        median[name] = B * T / statistics.median(values)
        # Tokens per CPU-second times threads: the rate if every thread had its own core.
        per_cpu[name] = B * T * args.threads / min(cpu_seconds[name])
        achieved = flops_per_token * per_cpu[name]
        print(
            f"{name:38s} {best[name]:10.0f} {median[name]:8.0f} {per_cpu[name]:10.0f} "
            f"{achieved / 1e9:8.1f} {achieved / cpu_peak:8.1%}"
        )
    print(
        f"ratio ours / transformers: best wall {best['ours'] / best['transformers']:.3f}, "
        f"median wall {median['ours'] / median['transformers']:.3f}, "
        f"CPU time {per_cpu['ours'] / per_cpu['transformers']:.3f}"
    )
    print("GFLOP/s and 'of peak' use CPU-time rates on both sides (model and matmul).")


def cpu_time_matmul_flops(threads: int, size: int = 1024, runs: int = 20) -> float:
    """fp32 matmul FLOP/s per CPU-second x threads (best of `runs`): steady under load."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        a @ b
        best = min(best, time.process_time() - start)
    return 2.0 * size**3 * threads / best


if __name__ == "__main__":
    main()
