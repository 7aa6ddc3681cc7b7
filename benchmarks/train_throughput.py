"""Training throughput of our SmolLM3: the trainer's step against its eager, unfused step and
against transformers' SmolLM3ForCausalLM.

Every variant gets the same shape, the same initial weights, the same batch and the same targets
(T per row: transformers gets them as `shift_labels`, so it does not shift and drop one), fp32,
AdamW (foreach) with grad clipping, and they run interleaved one step at a time in one process,
so machine noise hits all alike. transformers trains with `use_cache=False` (its default builds a
KV cache on every training forward). Variants of ours:

- `eager, 3 matmuls`: today's eager step before fused QKV (the baseline the new step is held to);
- `eager, fused QKV` and `compiled, 3 matmuls` / `compiled, fused QKV`: each speed option alone
  and together (`compiled` = the trainer's per-block `torch.compile`, `compile_blocks`);
- `new step`: what the trainer runs by default on this device (`compile_model: auto` resolved by
  `compiles_blocks`, the spec's default `fused_qkv`), with document masking and, on CPU,
  deterministic algorithms, as trainers/pretrain.py trains; `before, doc masking` is the eager
  unfused step under the same conditions.

Prints tokens/s of each (best and median wall, and per CPU-second x threads, the steady figure on
a shared machine), achieved FLOP/s as a fraction of this machine's fp32 matmul rate, and the
ratios: new step / before, new step / transformers, fused / unfused, compiled / eager.

    .venv/bin/python benchmarks/train_throughput.py                       # both shapes
    .venv/bin/python benchmarks/train_throughput.py --shape tiny --rounds 3 --threads 1

Shapes: `tiny` (8.35M parameters: vocab 4096, hidden 256, 9 layers, seq 256, batch 8) and
`ablation` (the 1B ablation preset's block: hidden 2048, 32 / 8 heads, SwiGLU 8192, at 2 of its
16 layers and a 8,192 vocabulary so that a CPU step takes seconds, seq 256, batch 1). Baseline
named by the project: on 2 CPU cores transformers reaches about 2,400 tokens/s on `tiny`; ours
must not be slower.
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
from model.spec import OptimizerConfig, TrainSettings  # noqa: E402
from trainers.pretrain import compile_blocks, compiles_blocks  # noqa: E402

SHAPES = {
    # (config, seq_len, batch)
    "tiny": (
        lambda: ModelConfig.tiny(
            vocab_size=4096, hidden_size=256, intermediate_size=800, num_layers=9, num_heads=4, num_kv_heads=2
        ),
        256,
        8,
    ),
    "ablation": (lambda: ModelConfig.ablation_1b(num_layers=2, vocab_size=8192), 256, 1),
}
BEFORE = "eager, 3 matmuls"
NEW = "new step (doc masking)"


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


def deterministic(step):
    """trainers.pretrain on CPU turns deterministic algorithms on (bit-exact resume)."""

    def wrapped(*args):
        torch.use_deterministic_algorithms(True)
        try:
            return step(*args)
        finally:
            torch.use_deterministic_algorithms(False)

    return wrapped


def ours(cfg, state, opt_spec, fused: bool, compiled: bool):
    model = SmolLM3(cfg).train()
    model.load_state_dict(state)
    model.set_fused_qkv(fused)
    if compiled:
        compile_blocks(model)
    return make_step(model, build_optimizer(model, opt_spec), ours_forward)


def variants_for(cfg, device: torch.device):
    """name -> (step, uses doc ids); every model starts from the same weights."""
    opt_spec = OptimizerConfig(lr=3e-4)
    torch.manual_seed(0)
    state = SmolLM3(cfg).state_dict()
    hf = to_hf_model(SmolLM3(cfg)).train()  # same shape and init statistics
    new_fused = TrainSettings.model_fields["fused_qkv"].default
    new_compiled = compiles_blocks(TrainSettings.model_fields["compile_model"].default, device)
    det = deterministic if device.type == "cpu" else (lambda step: step)
    return {
        BEFORE: (ours(cfg, state, opt_spec, False, False), False),
        "eager, fused QKV": (ours(cfg, state, opt_spec, True, False), False),
        "compiled, 3 matmuls": (ours(cfg, state, opt_spec, False, True), False),
        "compiled, fused QKV": (ours(cfg, state, opt_spec, True, True), False),
        "transformers": (make_step(hf, build_optimizer(hf, opt_spec), hf_forward), False),
        "before (doc masking)": (det(ours(cfg, state, opt_spec, False, False)), True),
        NEW: (det(ours(cfg, state, opt_spec, new_fused, new_compiled)), True),
    }, f"compile_model auto -> {'compiled' if new_compiled else 'eager'}, fused_qkv {new_fused}"


def run_shape(name: str, args) -> None:
    make_cfg, T, B = SHAPES[name]
    cfg = make_cfg().replace(max_seq_len=max(T, 1024))
    T, B = args.seq_len or T, args.batch or B
    device = torch.device("cpu")
    variants, new_is = variants_for(cfg, device)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    # Packed rows of 4 documents each: the intra-document masking path (dense mask on CPU).
    doc_ids = (torch.arange(T) * 4 // T).expand(B, T).contiguous()
    compile_s = {}
    for vname, (step, docs) in variants.items():  # warm-up: allocator, thread pools, compilation
        start = time.perf_counter()
        for _ in range(2):
            step(inputs, targets, doc_ids if docs else None)
        compile_s[vname] = time.perf_counter() - start
    # Alternate single steps so that load from other processes hits every variant alike; the
    # best step estimates the uncontended speed, the median the typical one. CPU time of this
    # process is recorded too: on a shared machine it is far steadier than wall time, since it
    # does not count the time other processes hold the cores.
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    cpu_seconds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds * args.steps):
        for vname, (step, docs) in variants.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(inputs, targets, doc_ids if docs else None)
            seconds[vname].append(time.perf_counter() - start)
            cpu_seconds[vname].append(time.process_time() - cpu_start)

    flops_per_token = training_flops_per_token(cfg, T)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"\n== {name}: {cfg.num_parameters():,} parameters, seq {T}, batch {B}, {args.threads} threads, fp32, "
        f"AdamW; load average {load:.1f} on {os.cpu_count()} CPUs; new step: {new_is}"
    )
    print(
        f"{'variant':28s} {'best tok/s':>10s} {'median':>8s} {'cpu tok/s':>10s} {'GFLOP/s':>8s} "
        f"{'of peak':>8s} {'warm-up s':>9s}"
    )
    best, median, per_cpu = {}, {}, {}
    for vname, values in seconds.items():
        best[vname] = B * T / min(values)
        median[vname] = B * T / statistics.median(values)
        # Tokens per CPU-second times threads: the rate if every thread had its own core.
        per_cpu[vname] = B * T * args.threads / min(cpu_seconds[vname])
        achieved = flops_per_token * per_cpu[vname]
        print(
            f"{vname:28s} {best[vname]:10.0f} {median[vname]:8.0f} {per_cpu[vname]:10.0f} "
            f"{achieved / 1e9:8.1f} {achieved / args.cpu_peak:8.1%} {compile_s[vname]:9.1f}"
        )
    for label, a, b in (
        ("new step / before", NEW, "before (doc masking)"),
        ("new step / transformers", NEW, "transformers"),
        ("fused / 3 matmuls, eager", "eager, fused QKV", BEFORE),
        ("fused / 3 matmuls, compiled", "compiled, fused QKV", "compiled, 3 matmuls"),
        ("compiled / eager, 3 matmuls", "compiled, 3 matmuls", BEFORE),
        ("eager 3 matmuls / transformers", BEFORE, "transformers"),
    ):
        print(
            f"ratio {label:31s} CPU time {per_cpu[a] / per_cpu[b]:.3f}, best wall {best[a] / best[b]:.3f}, "
            f"median wall {median[a] / median[b]:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--seq-len", type=int, default=None, help="override the shape's sequence length")
    parser.add_argument("--batch", type=int, default=None, help="override the shape's batch")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = measure_matmul_flops("cpu", torch.float32, size=1024, seconds=2.0)
    args.cpu_peak = cpu_time_matmul_flops(args.threads)
    print(
        f"fp32 1024^2 matmul peak, {args.threads} threads: best wall burst {peak / 1e9:.1f} "
        f"GFLOP/s, per CPU time x threads {args.cpu_peak / 1e9:.1f} GFLOP/s"
    )
    for name in SHAPES if args.shape == "all" else [args.shape]:
        run_shape(name, args)
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
