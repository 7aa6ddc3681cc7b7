"""The GPU check: one prepared run of every CUDA path of this project, printed as one table.

    python benchmarks/gpu_check.py                             # a CUDA machine, < 8 min on 1 H200
    python benchmarks/gpu_check.py --out gpu_check.md --out gpu_check.json
    python benchmarks/gpu_check.py --cpu-smoke                 # same code paths, toy size, CPU
    python benchmarks/gpu_check.py --plan                      # on CPU: the rows, shapes, memory and time
    python benchmarks/gpu_check.py --only rental --only checkpoint --only loader   # the rental rows alone

Rows, each PASS / FAIL / SKIP with what was measured (a warn of a preflight check is a PASS whose
detail starts with "WARN"):
- gpu_count, gpu_matmul, gpu_throttle, gpu_memory, gpu_ecc, dcgm_diag, nccl_allreduce: the preflight
  GPU checks (infra.preflight), run for real on the GPUs present (NVML through pynvml, DCGM through
  dcgmi when installed; NCCL all-reduce needs 2+ GPUs and skips on one);
- train_ours: `python -m trainers.pretrain` on the `ablation_1b` preset with the GPU defaults (bf16
  autocast, FlexAttention document masking) plus `compile_model`, on synthetic packed documents:
  tokens/s and MFU (median after warm-up, MFU against the bf16 matmul peak the trainer measures),
  peak CUDA memory, and whether the loss falls;
- train_transformers: transformers' SmolLM3ForCausalLM of the same shape (sdpa, bf16 autocast,
  eager, causal without document masking, `use_cache=False`, the same T targets per row through
  `shift_labels`), same AdamW and clipping, in this process;
- ratio_vs_transformers: ours / transformers tokens/s; PASS when ours is not slower;
- flex_fwd T=n, flex_bwd T=n: the model's flex path against SDPA with the same dense intra-document
  mask (fp32, GQA, several documents per row), logits and parameter gradients, at lengths that are
  and are not multiples of the 128-token block;
- resume_identical: a run SIGKILLed mid-stage and relaunched ends with weights bit-identical to an
  uninterrupted run (GPU defaults + compile_model, through `python -m trainers.pretrain`);
- memory ckpt=MODE T=n: one training step of the `ablation_1b` preset at seq 4,096 and 32,768 per
  activation checkpointing mode, as the trainer runs it on one GPU (FSDP2 bf16 mixed precision,
  FlexAttention document masking, chunked loss): measured peak (`torch.cuda.max_memory_allocated`)
  against model/memory.py's prediction, and tokens/s; PASS within 15%. A mode predicted not to
  fit the GPU is skipped, named;
- loss chunked T=n / loss unfused T=n: the loss alone (linear head + cross-entropy, forward and
  backward) at the 1B vocabulary: peak memory and time of model/loss.py against the unfused
  logits path;
- the rental rows, read from configs/smollm3-3b.yaml through the recipe loader and the stage
  planner (flows/stage_plan.py, `StageSpec.layout` and `.memory`, as `smollm3 capacity` reads
  them), never written here: the first pretraining stage and each long-context stage as ONE GPU
  of its published layout holds it. One process is rank 0 of the layout's whole world through
  torch's fake process group (collectives return at once, as torchtitan's `fake_backend` dry
  run): the model is built, laid out (TP, CP, FSDP2/HSDP), compiled and stepped as
  trainers/pretrain.py `build_stage` and `train_step` do, so the shards, gathered buffers,
  activations and compute are rank 0's; what it cannot show (communication time, NCCL buffers,
  the other ranks' values) each row's detail names;
  - 3b STAGE compiled / eager: optimizer steps (with the stage's accumulation): tokens/s per GPU,
    MFU (6N + 12 L h s FLOPs per token / tp, against the datasheet bf16 peak; attention counted
    over the full s x s as published MFUs count it), measured peak (`max_memory_allocated`)
    against model/memory.py's prediction for that GPU; PASS within 15%. stage1 packs about 6
    documents per row; the long-context rows train one document per sequence (long-context data
    are long documents): packed at 64k, the document mask skipped most attention blocks the
    formula counts and the H200 read MFU 94.6% (docs/model.md);
  - 3b stage1 compiled/eager: their tokens/s and MFU ratio; PASS when compiled is not slower;
  - 3b node TP 2 x HSDP over NCCL, 3b long-context CP 4 x TP 2 over NCCL, two-node scaling and
    fabric bandwidth: SKIP, named (no multi-GPU launch here yet);
  - ckpt save / ckpt load (1 GPU share): model/checkpoint.py's Checkpointer (DCP, SHA-256
    manifest, marker; `latest_verified` + `load`) writes and reads one GPU's share of the first
    stage's train state (parameters and AdamW moments in the shapes of rank 0's shards) on local
    disk, the page cache evicted before the read: GB/s each way, PASS when every tensor is equal;
  - loader start-up: model/token_shards.py's MixtureLoader opened as rank 0 of the stage's DP
    ranks over a synthetic corpus of the recipe's source count: seconds and host memory to the
    first batch.

`--cpu-smoke` runs the same functions at toy size on CPU, where the trainer's "auto" precision is
fp32 and its "auto" attention the dense SDPA mask (FlexAttention has no CPU backward), and memory
is measured with torch's MemTracker: the preflight rows that need CUDA, the flex backward rows and
the throughput judgements SKIP, each with its reason. The rental rows keep the recipe's layouts,
batches and checkpointing modes at toy widths and 1/128 of the lengths; after stage1's compiled
row they run eager (inductor's CPU compile of each shape would cost more than the rest).
`--plan` (no GPU needed) prints every row it would run, its shape, the predicted memory and the
expected seconds on one H200 (measured figures for the older rows, FLOPs at PLAN_MFU plus
COMPILE_S for the 3b rows), the total, and what --budget-s would skip.
A time budget (--budget-s) turns the rows it would overrun into named SKIPs. Exit status: 1 if any
row FAILs, else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.checkpoint import load_model, read_marker  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.hf import to_hf_model  # noqa: E402
from model.model import SmolLM3  # noqa: E402
from model.optim import build_optimizer  # noqa: E402
from model.spec import OptimizerConfig  # noqa: E402

PREFLIGHT_GPU_CHECKS = (
    "gpu_count",
    "gpu_matmul",
    "gpu_throttle",
    "gpu_memory",
    "gpu_ecc",
    "dcgm_diag",
    "nccl_allreduce",
)
FWD_TOLERANCE = 1e-4  # flex vs dense, fp32: max |diff| / max |logit|; mask errors are O(1)
BWD_TOLERANCE = 1e-3  # flex vs dense, fp32: max over parameters of max |diff| / max |grad|


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | SKIP
    value: str = ""  # what was measured, with units
    detail: str = ""  # the threshold, the setting, or why it failed or was skipped
    seconds: float = 0.0


@dataclass(frozen=True)
class Setup:
    """Sizes of one run: `gpu()` for the real check, `cpu_smoke()` for CI."""

    cuda: bool
    preset: str  # ModelConfig preset of the throughput rows
    overrides: dict  # ModelConfig overrides of the throughput rows
    seq_len: int
    micro_batch: int
    steps: int  # trainer steps of train_ours
    warmup: int  # leading steps left out of the throughput medians (compile, allocator)
    lr: float  # peak learning rate of every trainer run
    lr_warmup: int  # its linear warmup steps (a 1B model at full lr from step 1 can spike)
    hf_steps: int  # timed transformers steps (after `warmup_hf`)
    warmup_hf: int
    flex_model: dict  # ModelConfig.tiny overrides of the flex agreement rows
    flex_lengths: tuple[int, ...]
    resume_model: dict  # ModelConfig.tiny overrides of the resume row
    resume_seq_len: int
    memory_preset: str = "ablation_1b"  # ModelConfig preset of the memory rows
    memory_overrides: dict = field(default_factory=dict)
    memory_lengths: tuple[int, ...] = (4096, 32768)  # sequence lengths of the memory rows
    loss_lengths: tuple[int, ...] = (32768,)  # tokens of the loss rows
    preflight: dict = field(default_factory=dict)  # PreflightConfig overrides
    rental_model: dict = field(default_factory=dict)  # ModelConfig overrides of the 3b rows ({}: the recipe's model)
    rental_seq_div: int = 1  # the 3b rows' sequence lengths are the recipe's / this
    rental_steps: tuple[int, int] = (1, 2)  # (warm-up, timed) optimizer steps of each 3b row
    loader_shards: int = 64  # token shards per source of the loader row's corpus
    loader_tokens: int = 8192  # tokens per shard

    @staticmethod
    def gpu(args) -> Setup:
        return Setup(
            cuda=True,
            preset=args.preset,
            overrides={},
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            steps=args.steps,
            warmup=max(10, args.steps // 10),
            lr=3e-4,
            lr_warmup=min(20, args.steps // 5),
            hf_steps=30,
            warmup_hf=5,
            flex_model=dict(
                vocab_size=1024,
                hidden_size=512,
                intermediate_size=1024,
                num_layers=2,
                num_heads=8,
                num_kv_heads=2,
                no_rope_interval=2,
                max_seq_len=4096,
            ),
            flex_lengths=(1024, 1000, 4096, 4000),
            resume_model=dict(
                vocab_size=1024,
                hidden_size=512,
                intermediate_size=1024,
                num_layers=4,
                num_heads=8,
                num_kv_heads=2,
            ),
            resume_seq_len=1024,
            preflight=dict(dcgm_level=args.dcgm_level),
        )

    @staticmethod
    def cpu_smoke(args) -> Setup:
        tiny = dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            no_rope_interval=0,
        )
        return Setup(
            cuda=False,
            preset="tiny",
            overrides=tiny,
            seq_len=32,
            micro_batch=2,
            steps=4,
            warmup=1,
            lr=3e-3,  # a toy model learns visibly in 4 steps
            lr_warmup=0,
            hf_steps=3,
            warmup_hf=1,
            # head_dim 16: the shape at which inductor's CPU flex kernel broke (model/attention.py)
            flex_model=dict(tiny, no_rope_interval=2),
            flex_lengths=(128, 100, 40),
            resume_model=tiny,
            resume_seq_len=32,
            memory_preset="tiny",
            memory_overrides=dict(tiny, vocab_size=512),
            memory_lengths=(128, 256),
            loss_lengths=(1024,),
            preflight=dict(
                matmul_size=1024,
                matmul_seconds=0.5,
                gpu_memory_gib=0.25,
                dcgm_level=0,
                nccl_mib=4.0,
            ),
            # the recipe's layouts, batches and modes at toy widths; 4 heads and 2 KV heads split by TP 2
            rental_model=dict(tiny, vocab_size=256, no_rope_interval=2, max_seq_len=512),
            rental_seq_div=128,  # 4,096 -> 32; 32,768 / CP 4 -> 64 query tokens; 65,536 / CP 4 -> 128
            rental_steps=(1, 1),  # the warm-up, then the one timed step MemTracker measures on CPU
            loader_shards=3,
            loader_tokens=1024,
        )


class Budget:
    """Wall-clock budget of the whole check; sections that would overrun it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def skip(self, names: list[str], needs: float) -> list[Row] | None:
        if self.left() >= needs:
            return None
        why = (
            f"not run: {max(self.left(), 0):.0f} s of the --budget-s {self.seconds:.0f} left, "
            f"this part needs about {needs:.0f} s"
        )
        return [Row(n, "SKIP", detail=why) for n in names]


# ---- synthetic data and the trainer --------------------------------------------------------


def write_synthetic_plan(folder: Path, seq_len: int, vocab: int, tokens: int, seed: int = 0):
    """Packed documents in datatrove's shard layout (.ds tokens, .ds.index ends) and their plan.

    Token ids follow a Zipf law (id 0 is EOS, ending each document), so the unigram entropy is
    well below ln(vocab) and a falling loss shows the model learns. Documents are 1/8 to 1/2 of
    a sequence long, so every row packs several of them.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype, dtype_name = ("<u2", "uint16") if vocab <= 2**16 else ("<u4", "uint32")
    lengths, total = [], 0
    while total < tokens:
        lengths.append(int(rng.integers(max(2, seq_len // 8), max(3, seq_len // 2))))
        total += lengths[-1]
    body = (rng.zipf(1.2, size=total) - 1) % (vocab - 1) + 1  # ids 1 .. vocab-1
    ends = np.cumsum(lengths)
    body[ends - 1] = 0  # EOS closes each document
    path = folder / "000_synthetic.ds"
    body.astype(dtype).tofile(path)
    ends.astype("<u8").tofile(str(path) + ".index")
    plan = {
        "stage": "gpu_check",
        "seed": seed,
        "seq_len": seq_len,
        "tokens": total,
        "vocab_size": vocab,
        "eos_id": 0,
        "token_dtype": dtype_name,
        "sources": [
            {
                "name": "synthetic",
                "weight": 1.0,
                "files": [str(path)],
                "available_tokens": total,
                "budget_tokens": total,
                "expected_epochs": 1.0,
            }
        ],
    }
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder / "plan.json"


def trainer_env(threads: int | None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    env = os.environ | {"PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_trainer(spec: dict, folder: Path, threads: int | None) -> subprocess.Popen:
    """`python -m trainers.pretrain spec.json` in the background; output to folder/train.log."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    log = open(folder / "train.log", "w")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainers.pretrain", str(spec_path)],
        cwd=REPO,
        env=trainer_env(threads),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait for a trainer; kill it (None) when it outlives `timeout`."""
    try:
        rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    proc.log_file.close()  # type: ignore[attr-defined]
    return rc


def log_tail(folder: Path, lines: int = 6) -> str:
    text = (folder / "train.log").read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])[-800:]


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def base_spec(setup: Setup, plan: Path, out: Path, **kw) -> dict:
    spec = {
        "mixture_plan": str(plan),
        "out_dir": str(out),
        "device": "cuda" if setup.cuda else "cpu",
        "precision": "auto",  # the GPU default: bf16 autocast on CUDA (fp32 on CPU)
        "attention_backend": "auto",  # the GPU default: FlexAttention (dense SDPA mask on CPU)
        "compile_model": True,
        "optimizer": {"lr": setup.lr},
        "schedule": {"warmup_steps": setup.lr_warmup, "decay_fraction": 0.0},
        "log_interval": 1,
        "seed": 0,
    }
    if not setup.cuda:
        spec["num_threads"] = 1  # bit-reproducible CPU runs; two trainers share the cores
    return spec | kw


# ---- rows ------------------------------------------------------------------------------------


def preflight_rows(setup: Setup) -> list[Row]:
    from infra.preflight import PreflightConfig, PreflightFacts, run_preflight

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts = PreflightFacts(device="cuda" if setup.cuda else "cpu", nproc_per_node=max(n, 1))
    config = PreflightConfig(checks=PREFLIGHT_GPU_CHECKS, **setup.preflight)
    rows = []
    for r in run_preflight(config, facts, log=lambda _line: None):
        status = {"pass": "PASS", "warn": "PASS", "fail": "FAIL", "skip": "SKIP"}[r.status]
        detail = r.threshold if r.status == "pass" else r.advice
        if r.status == "warn":
            detail = f"WARN {r.advice} (threshold {r.threshold})"
        rows.append(Row(r.name, status, r.value, detail, r.seconds))
    return rows


def ours_rows(setup: Setup, work: Path, budget: Budget) -> tuple[list[Row], dict]:
    """The trainer at the throughput shape; returns its row and the figures the ratio needs."""
    start = time.monotonic()
    cfg = ModelConfig.from_preset(setup.preset, **setup.overrides)
    tokens = setup.steps * setup.micro_batch * (setup.seq_len + 1) + 4 * setup.seq_len
    plan = write_synthetic_plan(work / "data_ours", setup.seq_len, cfg.vocab_size, tokens)
    out = work / "ours"
    spec = base_spec(
        setup,
        plan,
        out,
        steps=setup.steps,
        global_batch=setup.micro_batch,
        micro_batch=setup.micro_batch,
        model_preset=setup.preset,
        model_overrides=setup.overrides,
        checkpoint_interval=setup.steps,  # only the stage-end save
        keep_last=1,
    )
    rc = finish(start_trainer(spec, out, None if setup.cuda else 1), budget.left())
    rows = read_metrics(out)
    seconds = time.monotonic() - start
    if rc != 0 or len(rows) != setup.steps:
        why = "timed out (budget)" if rc is None else f"exit {rc}"
        return [Row("train_ours", "FAIL", "", f"{why}: {log_tail(out)}", seconds)], {}
    timed = rows[setup.warmup :] or rows[-1:]
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    mfu = statistics.median(mfus) if mfus else None  # None: no known peak (CPU without preflight)
    peak = rows[-1]["mfu_peak_flops"]
    memory = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    losses = [r["loss"] for r in rows]
    first, last = losses[0], statistics.median(losses[-max(1, len(losses) // 10) :])
    learns = all(math.isfinite(x) for x in losses) and last < first
    value = (
        f"{tps:,.0f} tok/s, "
        + ("MFU n/a, " if mfu is None else f"MFU {100 * mfu:.1f}%, ")
        + (f"peak mem {max(memory):.1f} GiB, " if memory else "peak mem n/a (CPU), ")
        + f"loss {first:.3f} -> {last:.3f}"
    )
    detail = (
        f"{cfg.num_parameters() / 1e6:,.1f}M params ({setup.preset}), seq {setup.seq_len}, "
        f"micro batch {setup.micro_batch}, {setup.steps} steps, medians of steps "
        f"{setup.warmup + 1}-{setup.steps}; MFU vs {rows[-1]['mfu_peak_source']}"
        + (f" = {peak / 1e12:.3g} TFLOP/s; " if peak else "; ")
        + (
            "bf16 autocast, FlexAttention doc masking, compiled blocks, NCCL group"
            if setup.cuda
            else "fp32, dense-mask SDPA, compiled blocks, gloo group"
        )
    )
    if not learns:
        detail = f"loss did not fall (or is not finite); {detail}"
    row = Row("train_ours", "PASS" if learns else "FAIL", value, detail, seconds)
    return [row], {"tokens_per_s": tps, "cfg": cfg}


def transformers_rows(setup: Setup, ours: dict) -> list[Row]:
    """SmolLM3ForCausalLM of the same shape, same optimizer and clipping, timed in this process."""
    start = time.monotonic()
    cfg: ModelConfig = ours["cfg"]
    dev = torch.device("cuda" if setup.cuda else "cpu")
    torch.manual_seed(0)
    with torch.device(dev):
        hf = to_hf_model(SmolLM3(cfg)).to(dev).train()
    hf.set_attn_implementation("sdpa")
    optimizer = build_optimizer(hf, OptimizerConfig(lr=3e-4))
    params = list(hf.parameters())
    window = torch.randint(1, cfg.vocab_size, (setup.micro_batch, setup.seq_len + 1), device=dev)
    ids, targets = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if setup.cuda else nullcontext()
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    for _ in range(setup.warmup_hf + setup.hf_steps):
        t0 = time.perf_counter()
        with autocast:
            # No KV cache in training; the same T targets per row as ours (HF would shift labels).
            loss = hf(input_ids=ids, labels=targets, shift_labels=targets, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a sync per step, as the trainer's logging does
        times.append(time.perf_counter() - t0)
    memory = torch.cuda.max_memory_allocated(dev) / 2**30 if setup.cuda else None
    del hf, optimizer, params, loss
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
    tps = setup.micro_batch * setup.seq_len / statistics.median(times[setup.warmup_hf :])
    ours["hf_tokens_per_s"] = tps
    ok = all(math.isfinite(x) for x in losses)
    value = f"{tps:,.0f} tok/s" + (f", peak mem {memory:.1f} GiB" if memory is not None else "")
    detail = (
        f"SmolLM3ForCausalLM, same shape, sdpa, use_cache=False, T targets per row, "
        f"{'bf16 autocast' if setup.cuda else 'fp32'}, eager, causal (no document masking), "
        f"median of {setup.hf_steps} steps after {setup.warmup_hf}"
    )
    if not ok:
        detail = f"non-finite loss {losses}; {detail}"
    return [Row("train_transformers", "PASS" if ok else "FAIL", value, detail, time.monotonic() - start)]


def ratio_rows(setup: Setup, ours: dict) -> list[Row]:
    ratio = ours["tokens_per_s"] / ours["hf_tokens_per_s"]
    value = f"{ratio:.2f}x ({ours['tokens_per_s']:,.0f} / {ours['hf_tokens_per_s']:,.0f} tok/s)"
    if not setup.cuda:
        why = (
            "not judged on the CPU smoke: toy shapes measure overheads "
            "(benchmarks/train_throughput.py is the CPU comparison)"
        )
        return [Row("ratio_vs_transformers", "SKIP", value, why)]
    ok = ratio >= 1.0
    return [Row("ratio_vs_transformers", "PASS" if ok else "FAIL", value, ">= 1.00: ours is not slower")]


def packed_doc_ids(B: int, T: int, generator: torch.Generator) -> torch.Tensor:
    """(B, T) document ids, 0.. per row, about 6 documents per row."""
    starts = torch.rand(B, T, generator=generator) < 6 / T
    starts[:, 0] = False
    return starts.long().cumsum(dim=1)


def flex_rows(setup: Setup) -> list[Row]:
    """The model's flex path against SDPA with the same dense mask, fp32, at each length."""
    dev = torch.device("cuda" if setup.cuda else "cpu")
    cfg = ModelConfig.tiny(**setup.flex_model)
    torch.manual_seed(0)
    with torch.device(dev):
        sdpa = SmolLM3(cfg, attention_backend="sdpa")
        flex = SmolLM3(cfg, attention_backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in setup.flex_lengths:
        start = time.monotonic()
        ids = torch.randint(0, cfg.vocab_size, (2, T), generator=g).to(dev)
        doc_ids = packed_doc_ids(2, T, g).to(dev)
        shape = (
            f"T={T} ({'a' if T % 128 == 0 else 'not a'} multiple of 128), "
            f"{int(doc_ids.max(dim=1).values.min()) + 1}+ documents per row, GQA "
            f"{cfg.num_heads}:{cfg.num_kv_heads}, head_dim {cfg.head_dim}, fp32"
        )
        with torch.set_grad_enabled(setup.cuda):
            a = flex(ids, doc_ids, labels=ids, return_logits=True)
            b = sdpa(ids, doc_ids, labels=ids, return_logits=True)
        fwd = ((a.logits - b.logits).abs().max() / b.logits.abs().max()).item()
        ok = math.isfinite(fwd) and fwd <= FWD_TOLERANCE
        rows.append(
            Row(
                f"flex_fwd T={T}",
                "PASS" if ok else "FAIL",
                f"max rel diff {fwd:.1e}",
                f"<= {FWD_TOLERANCE:g}; {shape}",
                time.monotonic() - start,
            )
        )
        if not setup.cuda:
            rows.append(
                Row(
                    f"flex_bwd T={T}",
                    "SKIP",
                    detail="needs CUDA: FlexAttention has no backward on CPU",
                )
            )
            continue
        start = time.monotonic()
        a.loss.backward()
        b.loss.backward()
        rel = {}
        for (name, pa), pb in zip(flex.named_parameters(), sdpa.parameters(), strict=True):
            r = ((pa.grad - pb.grad).abs().max() / pb.grad.abs().max().clamp_min(1e-30)).item()
            rel[name] = r if math.isfinite(r) else math.inf
        name, worst = max(rel.items(), key=lambda kv: kv[1])
        flex.zero_grad(set_to_none=True)
        sdpa.zero_grad(set_to_none=True)
        ok = math.isfinite(worst) and worst <= BWD_TOLERANCE
        rows.append(
            Row(
                f"flex_bwd T={T}",
                "PASS" if ok else "FAIL",
                f"max rel grad diff {worst:.1e} ({name})",
                f"<= {BWD_TOLERANCE:g} over all parameters; {shape}",
                time.monotonic() - start,
            )
        )
    return rows


def resume_rows(setup: Setup, work: Path, budget: Budget) -> list[Row]:
    """SIGKILL after the step-4 checkpoint, relaunch, compare with an uninterrupted run."""
    start = time.monotonic()
    steps, B = 8, 2 * setup.micro_batch
    plan = write_synthetic_plan(
        work / "data_resume",
        setup.resume_seq_len,
        setup.resume_model["vocab_size"],
        (steps * B + 2) * (setup.resume_seq_len + 1),
        seed=1,
    )
    kw = dict(
        steps=steps,
        global_batch=B,
        micro_batch=setup.micro_batch,  # two micro-batches per step: accumulation too
        model_preset="tiny",
        model_overrides=setup.resume_model,
        checkpoint_interval=2,
        keep_last=4,
    )
    clean_dir, killed_dir = work / "resume_clean", work / "resume_killed"
    threads = None if setup.cuda else 1
    clean = start_trainer(base_spec(setup, plan, clean_dir, **kw), clean_dir, threads)
    killed_spec = base_spec(setup, plan, killed_dir, **kw, debug_step_sleep_s=0.5)
    killed = start_trainer(killed_spec, killed_dir, threads)
    target = killed_dir / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + budget.left()
    while read_marker(target) is None and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    rc_killed = finish(killed, 60)
    rc_clean = finish(clean, budget.left())
    if rc_clean != 0:
        return [
            Row(
                "resume_identical",
                "FAIL",
                "",
                f"uninterrupted run: exit {rc_clean}: {log_tail(clean_dir)}",
                time.monotonic() - start,
            )
        ]
    if rc_killed != -signal.SIGKILL or read_marker(target) is None:
        return [
            Row(
                "resume_identical",
                "FAIL",
                "",
                f"the run was not killed after its step-4 checkpoint (exit {rc_killed}): {log_tail(killed_dir)}",
                time.monotonic() - start,
            )
        ]
    rc = finish(start_trainer(killed_spec, killed_dir, threads), budget.left())
    if rc != 0:
        return [
            Row(
                "resume_identical",
                "FAIL",
                "",
                f"resumed run: exit {rc}: {log_tail(killed_dir)}",
                time.monotonic() - start,
            )
        ]
    final = f"checkpoints/step_{steps:08d}"
    a, b = load_model(clean_dir / final).state_dict(), load_model(killed_dir / final).state_dict()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    identical = all(torch.equal(a[k], b[k]) for k in a)
    clean_loss = [m["loss"] for m in read_metrics(clean_dir)]
    resumed_loss = [m["loss"] for m in read_metrics(killed_dir)]
    setting = f"{steps} steps, killed after step 4's checkpoint; " + (
        "bf16 autocast, FlexAttention, compiled blocks" if setup.cuda else "fp32, dense SDPA, compiled blocks"
    )
    if identical:
        return [
            Row(
                "resume_identical",
                "PASS",
                "bit-identical weights, equal losses" if clean_loss == resumed_loss else "bit-identical weights",
                setting,
                time.monotonic() - start,
            )
        ]
    if clean_loss[:4] != resumed_loss[:4]:
        why = (
            "steps 1-4 already differ between two runs before any kill: training is not "
            "bit-deterministic here, so no resume can be bit-identical"
        )
    else:
        why = "steps 1-4 agree but the resumed steps differ: the resume restores something wrongly"
    return [
        Row(
            "resume_identical",
            "FAIL",
            f"max abs weight diff {diff:.1e}",
            f"{why}; {setting}",
            time.monotonic() - start,
        )
    ]


# ---- the rental rows: the smollm3-3b recipe's per-GPU shapes ---------------------------------

RENTAL_RECIPE = "smollm3-3b"  # the recipe whose shapes the rental rows read (configs/)
RENTAL_TOLERANCE = 0.15  # measured peak vs model/memory.py's prediction, as the memory rows
PLAN_MFU = 0.35  # --plan's guess of the MFU a compiled step reaches (the ablation shape measured 38.9%)
PLAN_DEVICE = "NVIDIA H200"  # --plan's assumed GPU when none is visible: the one the check is sized for
COMPILE_S = 45.0  # --plan's guess: compiling one new shape of the 3B blocks (forward and backward)


@dataclass(frozen=True)
class Rental:
    """One stage of the rental recipe as ONE GPU of its published layout holds it."""

    stage: str
    spec: object  # the stage's TrainSpec (flows/stage_plan.py), seq_len shrunk on the CPU smoke
    cfg: ModelConfig  # the model it trains (toy widths on the CPU smoke)
    layout: object  # model/layout.py Layout: the stage's ranks
    mode: str  # activation checkpointing as the recipe check resolves it for the stage
    accum: int  # micro-batches per optimizer step on each rank
    kind: str = "pretrain"  # the stage's kind: "pretrain" or "long_context"

    @property
    def one_document(self) -> bool:
        """Long-context rows train one document per sequence (long-context data are long
        documents); the pretraining row packs about 6 per row. With several documents the
        document mask skips most attention blocks, which the MFU formula still counts: at 64k
        that read MFU 94.6% on the H200 (docs/model.md)."""
        return self.kind == "long_context"

    def doc_ids(self, gen: torch.Generator) -> torch.Tensor:
        """(micro-batch, seq) document ids of this row's synthetic sequences."""
        b, T = self.spec.micro_batch, self.seq_len
        return torch.zeros(b, T, dtype=torch.long) if self.one_document else packed_doc_ids(b, T, gen)

    def attention_note(self, cuda: bool) -> str:
        docs = "one document per sequence (causal mask)" if self.one_document else "about 6 documents per row"
        return f"{'FlexAttention' if cuda else 'dense-mask SDPA'}, {docs}"

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one GPU: micro-batch x seq / cp."""
        return self.spec.micro_batch * self.seq_len // self.layout.cp

    def predicted(self, device: str):
        """model/memory.py's prediction for one GPU of the layout (the recipe check's function)."""
        from model.memory import estimate, step_shape

        return estimate(step_shape(self.spec, self.cfg, self.layout, device), self.mode)

    def flops_per_token(self) -> float:
        """Training FLOPs per token on one GPU: the model's (model/flops.py) / tp; under CP each
        GPU's queries attend over the whole gathered sequence, which the attention term counts."""
        from model.flops import training_flops_per_token

        return training_flops_per_token(self.cfg, self.seq_len) / self.layout.tp

    def describe(self) -> str:
        spec, lay = self.spec, self.layout
        cp = f" / CP {lay.cp} = {self.seq_len // lay.cp:,} query tokens" if lay.cp > 1 else ""
        return (
            f"{self.stage} of {RENTAL_RECIPE}: {lay.describe()}, FSDP shard {lay.fsdp}; one GPU: "
            f"micro-batch {spec.micro_batch} x seq {self.seq_len:,}{cp}, accumulation {self.accum}, "
            f"checkpointing {self.mode}, {self.cfg.num_heads // lay.tp} of {self.cfg.num_heads} heads and "
            f"{self.cfg.intermediate_size // lay.tp:,} of {self.cfg.intermediate_size:,} SwiGLU width per GPU"
        )


def rental_stages(setup: Setup) -> list[Rental]:
    """The first pretraining stage and the long-context stages of the rental recipe, read through
    the recipe loader and the stage planner (flows/stage_plan.py) as `smollm3 capacity` reads them;
    the CPU smoke keeps their layouts, batches and modes at toy widths and lengths."""
    from flows.recipe import load_recipe
    from flows.stage_plan import schedule_stages
    from model.memory import model_config_of

    recipe = load_recipe(RENTAL_RECIPE)
    vocab = int(recipe.training.model_overrides.get("vocab_size", recipe.tokenizer.vocab_size))
    runs = [
        r.model_copy(update={"launch": r.on(recipe.launch)})
        for r in schedule_stages(recipe.training, recipe.stages, recipe.seed)
    ]
    pretrain = [r for r in runs if r.kind == "pretrain"][:1]
    chosen = pretrain + [r for r in runs if r.kind == "long_context"]
    stages = []
    for run in chosen:
        layout, mode = run.layout(), run.memory(vocab).mode
        spec, cfg = run.spec, model_config_of(run.spec, vocab)
        if setup.rental_model:
            spec = spec.model_copy(update={"seq_len": spec.seq_len // setup.rental_seq_div})
            cfg = cfg.replace(**setup.rental_model)
        accum = spec.global_batch // (spec.micro_batch * layout.dp)
        stages.append(Rental(run.name, spec, cfg, layout, mode, accum, run.kind))
    return stages


def _fake_group(world: int) -> None:
    """A `world`-rank process group of which this process is rank 0 and whose collectives do
    nothing (torch's fake backend, torchtitan's `fake_backend` dry run): the model is laid out,
    sharded and stepped exactly as rank 0 of the real launch, on one device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _rental_model(r: Rental, dev: torch.device, compiled: bool, meta: bool = False):
    """Rank 0 of the stage's layout, built as trainers/pretrain.py `build_stage` builds it: the
    model, its checkpointing and loss chunk, the CP group, TP + compile + FSDP2, AdamW."""
    from model.parallel import build_mesh, context_parallel, parallelize
    from trainers.pretrain import compile_blocks

    mesh = build_mesh(r.layout, dev.type, True)
    torch.manual_seed(0)
    with torch.device("meta" if meta else dev):
        model = SmolLM3(r.cfg, attention_backend=r.spec.attention_backend)
    if not meta:
        model.init_weights(seed=r.spec.seed)
    model.set_activation_checkpointing(r.mode)
    model.loss_chunk_tokens = r.spec.loss_chunk_tokens
    model.context_parallel = context_parallel(r.layout, mesh)
    parallelize(model, r.layout, mesh, dev, r.spec.precision, compile_blocks if compiled else None)
    return model


def _rental_measure(r: Rental, dev: torch.device, compiled: bool, setup: Setup) -> dict:
    """Peak memory and step time of optimizer steps of `r` on this device, rank 0 of a fake group."""
    import torch.distributed as dist

    _fake_group(r.layout.world)
    try:
        return _rental_steps(r, dev, compiled, setup)  # its model is gone when this returns
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _rental_steps(r: Rental, dev: torch.device, compiled: bool, setup: Setup) -> dict:
    """Warm-up then timed optimizer steps of rank 0 (train_step's loop without the data loader):
    the peak from CUDA's allocator, or MemTracker on one eager CPU step."""
    from trainers.pretrain import autocast_for

    model = _rental_model(r, dev, compiled)
    optimizer = build_optimizer(model, r.spec.optimizer)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    b, T = r.spec.micro_batch, r.seq_len
    ids = torch.randint(1, r.cfg.vocab_size, (b, T), generator=gen).to(dev)
    docs = r.doc_ids(gen).to(dev)
    labels = ids.roll(-1, 1)
    autocast = autocast_for(r.spec, dev)

    tracker = None  # MemTracker on CPU: its module statistics are per forward call

    def step():
        for micro in range(r.accum):
            if tracker is not None:
                tracker.reset_mod_stats()  # the global peak stays
            model.set_requires_gradient_sync(micro == r.accum - 1)
            with autocast:
                loss = model(ids, docs, labels).loss
            (loss / r.accum).backward()
        torch.nn.utils.clip_grad_norm_(params, r.spec.optimizer.grad_clip or 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warm, timed = setup.rental_steps
    t0 = time.perf_counter()
    for _ in range(warm):  # AdamW state, kernels, compilation
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    peak = None
    if dev.type == "cuda":
        for _ in range(timed):
            step()
        torch.cuda.synchronize(dev)
        peak = float(torch.cuda.max_memory_allocated(dev))
    elif not compiled:  # MemTracker sees every storage the dispatcher allocates (eager only)
        from torch.distributed._tools.mem_tracker import MemTracker

        for _ in range(timed - 1):
            step()
        tracker = MemTracker()
        tracker.track_external(model, optimizer, ids, labels, docs)
        with tracker:
            step()
        peak = float(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])
        tracker = None
    else:
        for _ in range(timed):
            step()
    seconds = (time.perf_counter() - t0) / timed
    return {"peak": peak, "step_s": seconds, "first_s": first, "tps": r.accum * r.local_tokens / seconds}


def _peak_flops(setup: Setup) -> float | None:
    from model.flops import datasheet_peak

    return datasheet_peak(torch.cuda.get_device_name(0)) if setup.cuda else None


def _single_gpu_note(r: Rental, setup: Setup) -> str:
    lay = r.layout
    comm = ["FSDP all-gathers and reduce-scatters", "HSDP's all-reduce across nodes" if lay.replicate > 1 else None,
            "TP's activation all-gathers and reduce-scatters" if lay.tp > 1 else None,
            f"CP's key/value all-gather over {lay.cp} GPUs (its gathered buffers are allocated and attended over; "
            "their contents are not the other GPUs')" if lay.cp > 1 else None]  # fmt: skip
    return (
        f"one GPU as rank 0 of {lay.world} (torch's fake process group): shards, gathered buffers and compute "
        f"are rank 0's; not represented: the time of {', '.join(c for c in comm if c)} (tokens/s is the "
        "compute-only bound), NCCL's buffers, and the data (other ranks' shards hold no real values, so the "
        "loss is not judged)"
    )


def rental_rows(setup: Setup, budget: Budget, stages: list[Rental]) -> list[Row]:
    """Each stage's per-GPU shape compiled (the first stage eager too, and their MFU ratio):
    tokens/s, MFU, measured peak against model/memory.py's prediction. A row that raises is a
    FAIL naming the error; the next rows still run."""
    dev = torch.device("cuda" if setup.cuda else "cpu")
    rows, mfu = [], {}
    for r in stages:
        for compiled in rental_modes(r, stages, setup):
            kind = "compiled" if compiled else "eager"
            name = f"3b {r.stage} {kind}"
            est = r.predicted(dev.type)
            needs = plan_seconds(r, compiled, setup)
            if budget.left() < needs:
                rows.append(Row(name, "SKIP", f"predicted {_size(est.peak_bytes)}",
                                f"not run: {max(budget.left(), 0):.0f} s of the --budget-s left, needs about {needs:.0f} s"))  # fmt: skip
                continue
            start = time.monotonic()
            try:
                row, figures = _rental_row(name, r, est, dev, compiled, setup)
                mfu[kind] = figures
            except Exception as exc:  # noqa: BLE001 (reported, not hidden)
                row = Row(name, "FAIL", f"predicted {_size(est.peak_bytes)}",
                          f"raised {type(exc).__name__}: {exc}"[:800] + f"; {r.describe()}")  # fmt: skip
                gc.collect()
                if setup.cuda:
                    torch.cuda.empty_cache()
            row.seconds = time.monotonic() - start
            rows.append(row)
            print(f"[gpu_check] {name}: {row.status} at {time.monotonic() - START:.0f} s", file=sys.stderr, flush=True)
        if r is stages[0]:
            rows.append(_compile_ratio_row(r, mfu, setup))
    return rows


def _rental_row(name: str, r: Rental, est, dev: torch.device, compiled: bool, setup: Setup) -> tuple[Row, tuple]:
    """One measured rental row and its (MFU, tokens/s)."""
    peak_flops = _peak_flops(setup)
    got = _rental_measure(r, dev, compiled, setup)
    m = r.flops_per_token() * got["tps"] / peak_flops if peak_flops else None
    value = f"{got['tps']:,.0f} tok/s/GPU, " + ("MFU n/a" if m is None else f"MFU {100 * m:.1f}%")
    status = "PASS"
    if got["peak"] is not None:
        error = est.peak_bytes / got["peak"] - 1
        value += f", measured {_size(got['peak'])}, predicted {_size(est.peak_bytes)} ({100 * error:+.1f}%)"
        status = "PASS" if abs(error) <= RENTAL_TOLERANCE else "FAIL"
    else:
        value += f", predicted {_size(est.peak_bytes)} (not measured: MemTracker cannot see inductor's CPU buffers)"
    detail = (
        f"{r.describe()}; {'compiled blocks' if compiled else 'eager blocks'}, "
        + ("bf16 mixed precision, " if setup.cuda else "fp32, ")
        + r.attention_note(setup.cuda)
        + f"; step {got['step_s']:.2f} s, first steps {got['first_s']:.0f} s; MFU = 6N + 12 L h s FLOPs per "
        f"token / tp x tokens/s per GPU / {'datasheet bf16 peak' if peak_flops else 'no peak on CPU'} "
        "(attention counted over the full s x s, not halved for causality nor reduced for document "
        f"masking: PaLM's convention, as published MFUs); "
        + (
            f"memory PASS within {RENTAL_TOLERANCE:.0%} of the prediction (peak phase {est.phase}); "
            if got["peak"] is not None
            else "memory not judged; "
        )
        + _single_gpu_note(r, setup)
    )
    return Row(name, status, value, detail), (m, got["tps"])


def _compile_ratio_row(r: Rental, mfu: dict, setup: Setup) -> Row:
    name = f"3b {r.stage} compiled/eager"
    if "compiled" not in mfu or "eager" not in mfu:
        return Row(name, "SKIP", detail="needs both the compiled and the eager row")
    (mc, tc), (me, te) = mfu["compiled"], mfu["eager"]
    value = f"{tc / te:.2f}x tokens/s ({tc:,.0f} / {te:,.0f})" + (
        f", MFU {100 * mc:.1f}% vs {100 * me:.1f}%" if mc is not None and me is not None else ""
    )
    if not setup.cuda:
        return Row(name, "SKIP", value, "not judged on the CPU smoke: toy shapes measure overheads")
    ok = tc >= te
    return Row(name, "PASS" if ok else "FAIL", value, ">= 1.00: compiled blocks are not slower; same shape, same step")


def multi_gpu_rows(setup: Setup) -> list[Row]:
    """What one GPU cannot measure, named."""
    n = torch.cuda.device_count() if setup.cuda else 0
    why = (
        f"needs {{}}; found {n} GPU{'s' if n != 1 else ''} (this check has no multi-GPU launch yet: "
        "the 3b rows above measure one GPU's share with free collectives)"
    )
    return [
        Row("3b node TP 2 x HSDP over NCCL", "SKIP", detail=why.format("the 8 GPUs of one node")),
        Row("3b long-context CP 4 x TP 2 over NCCL", "SKIP", detail=why.format("8 GPUs of one node")),
        Row("two-node scaling and fabric bandwidth", "SKIP", detail=why.format("2 nodes")),
    ]


# ---- checkpoint of the per-GPU share ---------------------------------------------------------


def _share_model(r: Rental, dev: torch.device) -> tuple[SmolLM3, torch.optim.Optimizer, int]:
    """A plain module whose parameters have the shapes of rank 0's shards at the layout of `r`
    (read from the model laid out on a fake group), with AdamW's state after one step: what one
    GPU writes into the stage's DCP checkpoint. Returns it, its optimizer and its state bytes."""
    import torch.distributed as dist

    _fake_group(r.layout.world)
    try:
        laid = _rental_model(r, torch.device("cpu") if dev.type == "cpu" else dev, False, meta=True)
        shapes = {
            n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
            for n, p in laid.named_parameters()
        }
    finally:
        dist.destroy_process_group()
    with torch.device("meta"):
        model = SmolLM3(r.cfg)
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, shape in shapes.items():
        owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        owner._parameters[leaf] = torch.nn.Parameter(torch.randn(shape, device=dev, generator=gen))
    optimizer = build_optimizer(model, r.spec.optimizer)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=dev, generator=gen)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in model.parameters())
    return model, optimizer, 12 * n  # fp32 parameters + AdamW's two moments


def _drop_from_page_cache(folder: Path) -> None:
    """Evict the written files from the page cache, so the read measures the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def checkpoint_rows(setup: Setup, work: Path, stages: list[Rental]) -> list[Row]:
    """model/checkpoint.py's Checkpointer saves and loads one GPU's share of the first stage's
    train state (DCP, SHA-256 manifest, marker) on local disk: GB/s each way, and equality."""
    from model.checkpoint import Checkpointer
    from model.memory import state_bytes

    r = stages[0]
    dev = torch.device("cuda" if setup.cuda else "cpu")
    start = time.monotonic()
    model, optimizer, nbytes = _share_model(r, dev)
    full, _ = state_bytes(r.cfg, 1, 1)
    expected, _ = state_bytes(r.cfg, r.layout.tp, r.layout.fsdp)
    root = work / "ckpt_share"
    sync = torch.cuda.synchronize if setup.cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    folder = Checkpointer(root, keep_last=1).save(1, model, optimizer, {"gpu_check": True}, stage_end=True)
    write_s = time.perf_counter() - t0
    on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    _drop_from_page_cache(folder)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in optimizer.state.values()]
    with torch.no_grad():  # overwrite everything the load must restore
        for p in model.parameters():
            p.zero_()
        for s in optimizer.state.values():
            s["exp_avg"].zero_()
            s["exp_avg_sq"].zero_()
    ckpt = Checkpointer(root, keep_last=1)
    t0 = time.perf_counter()
    found = ckpt.latest_verified()
    ckpt.load(found, model, optimizer, verified=True)
    sync()
    read_s = time.perf_counter() - t0
    equal = all(torch.equal(reference[k], v) for k, v in model.state_dict().items()) and all(
        torch.equal(a, s["exp_avg"]) and torch.equal(b, s["exp_avg_sq"])
        for (a, b), s in zip(moments, optimizer.state.values(), strict=True)
    )
    where = f"{r.stage} layout {r.layout.describe()}: TP {r.layout.tp} x FSDP shard {r.layout.fsdp}"
    share = (
        f"{_size(nbytes)} = one GPU's share of the {_size(full)} train state (fp32 parameters and AdamW's "
        f"two moments; gradients are not saved) at {where} (model/memory.py state_bytes: {_size(expected)})"
    )
    rows = [
        Row("ckpt save (1 GPU share)", "PASS", f"{_size(on_disk)} on disk in {write_s:.1f} s = {on_disk / write_s / 1e9:.2f} GB/s",
            f"{share}; Checkpointer.save: DCP write, fsync, SHA-256 manifest, marker; local disk {work}", write_s),
        Row("ckpt load (1 GPU share)", "PASS" if equal else "FAIL",
            f"{read_s:.1f} s = {on_disk / read_s / 1e9:.2f} GB/s, " + ("every tensor equal" if equal else "tensors DIFFER"),
            "latest_verified (SHA-256 of every file) + Checkpointer.load (DCP read, set_state_dict) after evicting the "
            "files from the page cache; PASS when every parameter and AdamW moment equals the saved one", read_s),
    ]  # fmt: skip
    del model, optimizer, reference, moments
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)
    rows[0].seconds = time.monotonic() - start - read_s
    return rows


# ---- loader start-up -------------------------------------------------------------------------


def write_corpus(folder: Path, sources: int, shards: int, vocab: int, tokens_per_shard: int) -> Path:
    """`sources` x `shards` small token shards (datatrove layout, with metadata) and their plan."""
    rng = np.random.default_rng(0)
    dtype, name = ("<u2", "uint16") if vocab <= 2**16 else ("<u4", "uint32")
    body = rng.integers(1, vocab, size=tokens_per_shard).astype(dtype)
    ends = np.cumsum(np.full(8, tokens_per_shard // 8)).astype("<u8")
    ends[-1] = tokens_per_shard
    plan_sources = []
    for s in range(sources):
        files = []
        for k in range(shards):
            path = folder / f"src{s:03d}" / f"{k:05d}.ds"
            path.parent.mkdir(parents=True, exist_ok=True)
            body.tofile(path)
            ends.tofile(str(path) + ".index")
            Path(str(path) + ".metadata").write_text(f"synthetic|{np.dtype(dtype).itemsize}\n{tokens_per_shard}\n")
            files.append(str(path))
        n = shards * tokens_per_shard
        plan_sources.append({"name": f"src{s:03d}", "weight": 1.0, "files": files, "available_tokens": n,
                             "budget_tokens": n, "expected_epochs": 1.0})  # fmt: skip
    plan = {"stage": "gpu_check", "seed": 0, "seq_len": 4096, "tokens": sources * shards * tokens_per_shard,
            "vocab_size": vocab, "eos_id": 0, "token_dtype": name, "sources": plan_sources}  # fmt: skip
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder / "plan.json"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def loader_rows(setup: Setup, work: Path, stages: list[Rental]) -> list[Row]:
    """Open model/token_shards.py's MixtureLoader as one rank of the first stage does, over a
    synthetic corpus of the recipe's source count: seconds and host memory to the first batch."""
    import tracemalloc

    from flows.recipe import load_recipe
    from model.token_shards import MixtureLoader, MixturePlan

    r = stages[0]
    sources = len(load_recipe(RENTAL_RECIPE).sources)
    start = time.monotonic()
    plan_path = write_corpus(work / "corpus", sources, setup.loader_shards, r.cfg.vocab_size, setup.loader_tokens)
    write_s = time.monotonic() - start
    shards = sources * setup.loader_shards
    gc.collect()
    rss0 = _rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    plan = MixturePlan.load(plan_path)
    loader = MixtureLoader(plan, seq_len=r.seq_len, rank=0, world_size=r.layout.dp, vocab_size=r.cfg.vocab_size,
                           open_shards=r.spec.loader.open_shards, prefetch=r.spec.loader.prefetch)  # fmt: skip
    opened = time.perf_counter() - t0
    batch = loader.next_batch(r.spec.micro_batch)
    first = time.perf_counter() - t0
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = _rss_bytes() - rss0
    loader.close()
    ok = batch.input_ids.shape == (r.spec.micro_batch, r.seq_len)
    value = (f"open {opened:.2f} s, first batch {first:.2f} s; host memory peak {traced / 1e6:.1f} MB "
             f"(tracemalloc), RSS +{max(rss, 0) / 1e6:.1f} MB")  # fmt: skip
    detail = (
        f"rank 0 of DP {r.layout.dp} ({r.stage}), {sources} sources ({RENTAL_RECIPE}) x {setup.loader_shards} shards = "
        f"{shards:,} shards of {setup.loader_tokens:,} tokens on local disk (written in {write_s:.0f} s), "
        f"micro-batch {r.spec.micro_batch} x {r.seq_len:,}, open_shards {r.spec.loader.open_shards}, prefetch "
        f"{r.spec.loader.prefetch}; start-up reads one file size per shard: {1e6 * opened / shards:.0f} us per shard"
        "; PASS when the first batch has its shape"
    )
    shutil.rmtree(work / "corpus", ignore_errors=True)
    return [Row("loader start-up", "PASS" if ok else "FAIL", value, detail, time.monotonic() - start)]


# ---- --plan: what the check would run, and how long -----------------------------------------

# Seconds of the sections that are not the rental rows, on one H200 (docs/model.md, 2026-12-04:
# train_ours 118 + train_transformers 13, resume 49, ...), plus start-up (imports, CUDA context).
MEASURED_S = {"start-up": 11.0, "preflight": 5.0, "train": 131.0, "flex": 4.0, "resume": 49.0, "memory": 13.0,
              "loss": 2.0}  # fmt: skip


def plan_seconds(r: Rental, compiled: bool, setup: Setup) -> float:
    """Expected seconds of one rental row on the GPU the check is sized for: building and laying
    out the model, compiling (COMPILE_S), and its steps at PLAN_MFU (eager: 3/4 of it; `full`
    recompute: 4/3 the FLOPs); a few seconds on the CPU smoke."""
    if not setup.cuda and setup.rental_model:
        return 5.0
    from model.flops import datasheet_peak

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else PLAN_DEVICE
    peak = datasheet_peak(name) or datasheet_peak(PLAN_DEVICE)
    mfu = PLAN_MFU * (1.0 if compiled else 0.75)
    recompute = 4 / 3 if r.mode == "full" else 1.0
    step = r.accum * r.local_tokens * r.flops_per_token() * recompute / (peak * mfu)
    return 15.0 + (COMPILE_S if compiled else 0.0) + sum(setup.rental_steps) * step


def checkpoint_seconds(r: Rental, setup: Setup) -> float:
    """Building the share, then writing and reading it at an assumed 2 GB/s and hashing it twice
    (the manifest, the verification) at 1.5 GB/s."""
    from model.memory import state_bytes

    share, _ = state_bytes(r.cfg, r.layout.tp, r.layout.fsdp)
    return 5.0 + share / 1e9 * (2 / 2.0 + 2 / 1.5)


def loader_seconds(setup: Setup) -> float:
    return 5.0 + 71 * setup.loader_shards * 1e-3  # ~1 ms per shard written (three small files)


def plan_rows(setup: Setup, sections: tuple[str, ...]) -> list[tuple[str, str, str, float]]:
    """(row, shape, predicted memory, expected seconds) of every row the check would run."""
    from model.memory import StepShape, estimate

    rows: list[tuple[str, str, str, float]] = [("start-up", "imports, CUDA context", "", MEASURED_S["start-up"])]
    if "preflight" in sections:
        rows.append(
            (", ".join(PREFLIGHT_GPU_CHECKS), "infra.preflight on the GPUs present", "", MEASURED_S["preflight"])
        )
    if "train" in sections:
        shape = f"{setup.preset}, micro-batch {setup.micro_batch} x seq {setup.seq_len}, {setup.steps} steps"
        rows.append(("train_ours, train_transformers, ratio", shape, "", MEASURED_S["train"]))
    if "flex" in sections:
        rows.append(("flex_fwd, flex_bwd", f"T = {', '.join(map(str, setup.flex_lengths))}", "", MEASURED_S["flex"]))
    if "resume" in sections:
        rows.append(("resume_identical", "3 trainer launches, 8 steps", "", MEASURED_S["resume"]))
    if "memory" in sections:
        cfg = ModelConfig.from_preset(setup.memory_preset, **setup.memory_overrides)
        for T in setup.memory_lengths:
            for mode in ("none", "selective", "full"):
                est = estimate(StepShape(cfg.replace(max_seq_len=max(T, cfg.max_seq_len)), T, 1, wrapped=True), mode)
                each = MEASURED_S["memory"] / (3 * len(setup.memory_lengths))
                rows.append(
                    (f"memory ckpt={mode} T={T}", f"{setup.memory_preset}, micro-batch 1", _size(est.peak_bytes), each)
                )
    if "loss" in sections:
        rows.append(
            ("loss chunked, loss unfused", f"T = {', '.join(map(str, setup.loss_lengths))}", "", MEASURED_S["loss"])
        )
    stages = rental_stages(setup) if {"rental", "checkpoint", "loader"} & set(sections) else []
    if "checkpoint" in sections and stages:
        from model.memory import state_bytes

        share, _ = state_bytes(stages[0].cfg, stages[0].layout.tp, stages[0].layout.fsdp)
        rows.append(("ckpt save, ckpt load (1 GPU share)", f"{_size(share)}: {stages[0].stage} at {stages[0].layout.describe()}",
                     _size(share), checkpoint_seconds(stages[0], setup)))  # fmt: skip
    if "loader" in sections and stages:
        rows.append(("loader start-up", f"{setup.loader_shards} shards per source", "", loader_seconds(setup)))
    if "rental" in sections:
        for r in stages:
            for compiled in rental_modes(r, stages, setup):
                kind = "compiled" if compiled else "eager"
                est = r.predicted("cuda" if setup.cuda or not setup.rental_model else "cpu")
                rows.append(
                    (f"3b {r.stage} {kind}", r.describe(), _size(est.peak_bytes), plan_seconds(r, compiled, setup))
                )
    return rows


def rental_modes(r: Rental, stages: list[Rental], setup: Setup) -> tuple[bool, ...]:
    """Compiled (True) and/or eager rows of a stage: the first stage both (their MFU ratio), the
    others compiled on GPU and eager on the CPU smoke (inductor's CPU compile of each shape costs
    more than the smoke's whole budget for them)."""
    if r is stages[0]:
        return (True, False)
    return (setup.cuda,)


def format_plan(rows: list[tuple[str, str, str, float]], budget_s: float, device: str) -> str:
    lines = [f"GPU check plan on {device}: {len(rows)} parts, --budget-s {budget_s:.0f}", ""]
    width = max(len(r[0]) for r in rows)
    lines.append(f"{'rows':<{width}}  {'expected s':>10}  {'predicted':>10}  shape")
    total = 0.0
    for name, shape, memory, seconds in rows:
        total += seconds
        over = "  (over the budget: SKIP)" if total > budget_s else ""
        lines.append(f"{name:<{width}}  {seconds:>10.0f}  {memory:>10}  {shape}{over}")
    lines.append(
        f"{'total':<{width}}  {total:>10.0f}  {'':>10}  "
        + ("within" if total <= budget_s else "OVER")
        + f" the {budget_s:.0f} s budget"
    )
    return "\n".join(lines)


# ---- table -----------------------------------------------------------------------------------


def _one_rank_group(cuda: bool):
    """A private one-process group (NCCL on GPU, gloo on CPU), as the trainer makes without torchrun."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0) if cuda else None,
    )
    return True


def memory_rows(setup: Setup, budget: Budget) -> list[Row]:
    """One training step per checkpointing mode and length: measured peak against model/memory.py."""
    import torch.distributed as dist

    from model.memory import StepShape, estimate

    dev = torch.device("cuda" if setup.cuda else "cpu")
    cfg = ModelConfig.from_preset(setup.memory_preset, **setup.memory_overrides)
    owns = _one_rank_group(setup.cuda)
    rows = []
    total = torch.cuda.get_device_properties(dev).total_memory if setup.cuda else None
    try:
        for T in setup.memory_lengths:
            for mode in ("none", "selective", "full"):
                name = f"memory ckpt={mode} T={T}"
                start = time.monotonic()
                shape = StepShape(cfg.replace(max_seq_len=max(T, cfg.max_seq_len)), T, 1, device=dev.type,
                                  wrapped=setup.cuda)  # fmt: skip
                est = estimate(shape, mode)
                if total is not None and est.budget_gb() * 1e9 > total:
                    why = f"predicted {est.budget_gb():.1f} GB with context and fragmentation > {total / 1e9:.1f} GB"
                    rows.append(Row(name, "SKIP", f"predicted {est.peak_gb:.1f} GB", f"not run: {why}"))
                    continue
                if budget.left() < (40 if setup.cuda else 5):
                    rows.append(Row(name, "SKIP", detail=f"not run: {max(budget.left(), 0):.0f} s of the budget left"))
                    continue
                got, tps = _measure_memory(shape, mode, dev, setup)
                error = est.peak_bytes / got - 1
                value = f"measured {_size(got)}, predicted {_size(est.peak_bytes)} ({100 * error:+.1f}%)"
                if tps:
                    value += f", {tps:,.0f} tok/s"
                detail = (
                    f"{setup.memory_preset}, micro batch 1, "
                    + (
                        "FSDP2 bf16 mixed precision, FlexAttention, cuda max_memory_allocated"
                        if setup.cuda
                        else "fp32, dense mask, MemTracker"
                    )  # fmt: skip
                    + f"; peak phase {est.phase}; PASS within 15%"
                )
                ok = abs(error) <= 0.15
                rows.append(Row(name, "PASS" if ok else "FAIL", value, detail, time.monotonic() - start))
                gc.collect()
                if setup.cuda:
                    torch.cuda.empty_cache()
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()
    return rows


def _measure_memory(shape, mode: str, dev: torch.device, setup: Setup) -> tuple[float, float | None]:
    """(peak bytes, tokens/s) of training steps of `shape` in `mode` on `dev`."""
    from model.layout import Layout
    from model.memory import measured_step_peak
    from model.parallel import build_mesh, parallelize

    cfg, T = shape.cfg, shape.seq_len
    torch.manual_seed(0)
    with torch.device(dev):
        model = SmolLM3(cfg)
    model.set_activation_checkpointing(mode)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (1, T), generator=gen).to(dev)
    docs = packed_doc_ids(1, T, gen).to(dev)
    labels = ids.roll(-1, 1)
    if not setup.cuda:  # one plain CPU rank, as the trainer; MemTracker sees every storage
        return float(measured_step_peak(model, build_optimizer(model, OptimizerConfig()), ids, labels, docs)), None
    layout = Layout(world=1)
    parallelize(model, layout, build_mesh(layout, "cuda", True), dev, "auto")
    optimizer = build_optimizer(model, OptimizerConfig())
    params = list(model.parameters())

    def step():
        model(ids, docs, labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # AdamW state, kernels
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(2):
        step()
    torch.cuda.synchronize(dev)
    tps = 2 * T / (time.perf_counter() - t0)
    return float(torch.cuda.max_memory_allocated(dev)), tps  # the model goes with this frame


def loss_rows(setup: Setup) -> list[Row]:
    """model/loss.py against the unfused logits path: peak memory and time of forward + backward."""
    from model.loss import linear_cross_entropy, reference_cross_entropy

    dev = torch.device("cuda" if setup.cuda else "cpu")
    cfg = ModelConfig.from_preset(setup.memory_preset, **setup.memory_overrides)
    dtype = torch.bfloat16 if setup.cuda else torch.float32
    rows = []
    for n in setup.loss_lengths:
        gen = torch.Generator().manual_seed(0)
        h = (torch.randn(n, cfg.hidden_size, generator=gen) * 0.5).to(dev, dtype)
        w = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dev, dtype)
        y = torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(dev)
        results = {}
        for name, fn in (("chunked", linear_cross_entropy), ("unfused", reference_cross_entropy)):
            start = time.monotonic()
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            peak, seconds, loss = _loss_peak(fn, hh, ww, y, dev)
            results[name] = (peak, loss, hh.grad, ww.grad)
            value = f"peak {_size(peak)} (inputs and gradients included), {seconds * 1e3:.0f} ms fwd+bwd"
            detail = f"{n} tokens x vocabulary {cfg.vocab_size}, {str(dtype).split('.')[-1]}"
            rows.append(Row(f"loss {name} T={n}", "PASS", value, detail, time.monotonic() - start))
        (pc, lc, hc, wc), (pu, lu, hu, wu) = results["chunked"], results["unfused"]
        same = abs(lc - lu) <= 1e-3 * abs(lu) and all(
            torch.allclose(a.float(), b.float(), rtol=5e-2, atol=1e-4) for a, b in ((hc, hu), (wc, wu))
        )
        if not same or pc >= pu:
            rows[-2] = Row(rows[-2].check, "FAIL", rows[-2].value,
                           f"loss {lc:.5f} vs unfused {lu:.5f}, peak {_size(pc)} vs {_size(pu)}")  # fmt: skip
    return rows


def _size(n: float) -> str:
    """Bytes as `12.34 GB`, or `5.6 MB` below a GB (the CPU smoke's toy sizes)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _loss_peak(fn, h, w, y, dev: torch.device) -> tuple[float, float, float]:
    """(peak bytes, seconds, loss) of fn's forward and backward."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = fn(h, w, y)
        loss.backward()
        torch.cuda.synchronize(dev)
        return float(torch.cuda.max_memory_allocated(dev)), time.perf_counter() - t0, loss.item()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(h, w, y)
    t0 = time.perf_counter()
    with tracker:
        loss = fn(h, w, y)
        loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    return float(peak), time.perf_counter() - t0, loss.item()


def format_table(rows: list[Row]) -> str:
    head = ("check", "status", "s", "value", "detail")
    cells = [(r.check, r.status, f"{r.seconds:.0f}", r.value, r.detail) for r in rows]
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:4], widths, strict=True)) + "  " + head[4]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    for c in cells:
        lines.append("  ".join(x.ljust(w) for x, w in zip(c[:4], widths, strict=True)) + "  " + c[4])
    lines.append(summary_line(rows))
    return "\n".join(line.rstrip() for line in lines)


def format_markdown(rows: list[Row], meta: dict) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = [
        f"GPU check ({meta['mode']}) on {meta['device']}, torch {meta['torch']}, {meta['seconds']:.0f} s",
        "",
        "| check | status | s | value | detail |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {esc(r.check)} | {r.status} | {r.seconds:.0f} | {esc(r.value)} | {esc(r.detail)} |" for r in rows]
    return "\n".join([*lines, "", summary_line(rows)]) + "\n"


def summary_line(rows: list[Row]) -> str:
    return ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in ("PASS", "FAIL", "SKIP"))


def run_section(rows: list[Row], name: str, fn, *args) -> None:
    """A section that raises is a FAIL row naming the error, never a crash of the whole check."""
    start = time.monotonic()
    try:
        rows.extend(fn(*args))
    except Exception as exc:  # noqa: BLE001 (reported, not hidden)
        rows.append(
            Row(
                name,
                "FAIL",
                "",
                f"raised {type(exc).__name__}: {exc}"[:800],
                time.monotonic() - start,
            )
        )
    print(f"[gpu_check] {name}: done at {time.monotonic() - START:.0f} s", file=sys.stderr, flush=True)


SECTIONS = ("preflight", "train", "flex", "resume", "memory", "loss", "rental", "checkpoint", "loader")


def train_sections(rows: list[Row], setup: Setup, work: Path, budget: Budget) -> None:
    """train_ours, then transformers' model of the same shape and the ratio, unless over budget."""
    # Rough needs: the 1B trainer compiles (~2 min) and runs its steps; the rest is small.
    ours_names = ["train_ours", "train_transformers", "ratio_vs_transformers"]
    skipped = budget.skip(ours_names, 60 if setup.cuda else 10)
    if skipped:
        rows += skipped
        return
    ours: dict = {}

    def train_ours() -> list[Row]:
        section, figures = ours_rows(setup, work, budget)
        ours.update(figures)
        return section

    run_section(rows, "train_ours", train_ours)
    if not ours.get("tokens_per_s"):
        rows += [Row(n, "SKIP", detail="train_ours failed") for n in ours_names[1:]]
        return
    run_section(rows, "train_transformers", transformers_rows, setup, ours)
    if ours.get("hf_tokens_per_s"):
        rows += ratio_rows(setup, ours)
    else:
        rows.append(Row("ratio_vs_transformers", "SKIP", detail="transformers row failed"))


def rental_sections(rows: list[Row], setup: Setup, work: Path, budget: Budget, sections: tuple[str, ...]) -> None:
    """The rows that answer the rental question: the recipe's per-GPU shapes, what one GPU cannot
    show, the checkpoint of one GPU's share, the loader's start-up."""
    wanted = [s for s in ("rental", "checkpoint", "loader") if s in sections]
    if not wanted:
        return
    stages: list[Rental] = []

    def read() -> list[Row]:
        stages.extend(rental_stages(setup))
        return []

    run_section(rows, f"recipe {RENTAL_RECIPE}", read)
    if not stages:
        return
    if "checkpoint" in sections:
        names = ["ckpt save (1 GPU share)", "ckpt load (1 GPU share)"]
        skipped = budget.skip(names, checkpoint_seconds(stages[0], setup) if setup.cuda else 5)
        rows += skipped or []
        if not skipped:
            run_section(rows, "ckpt save (1 GPU share)", checkpoint_rows, setup, work, stages)
    if "loader" in sections:
        skipped = budget.skip(["loader start-up"], loader_seconds(setup) if setup.cuda else 5)
        rows += skipped or []
        if not skipped:
            run_section(rows, "loader start-up", loader_rows, setup, work, stages)
    if "rental" in sections:
        run_section(rows, "rental", rental_rows, setup, budget, stages)
        rows += multi_gpu_rows(setup)


START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU (for CI)")
    parser.add_argument(
        "--out",
        action="append",
        default=[],
        metavar="FILE.json|FILE.md",
        help="also write the table there (repeatable)",
    )
    parser.add_argument("--preset", default="ablation_1b", help="model preset of the throughput rows")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="trainer steps of train_ours")
    parser.add_argument("--dcgm-level", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip what would run past this")
    parser.add_argument("--workdir", help="keep data, checkpoints and logs here (default: a temp dir, removed)")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print every row it would run, its shape, predicted memory and expected seconds; run nothing",
    )
    parser.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these parts (repeatable): {', '.join(SECTIONS)}")  # fmt: skip
    args = parser.parse_args(argv)
    sections = tuple(args.only or SECTIONS)
    for out in args.out:
        if not out.endswith((".json", ".md")):
            parser.error(f"--out {out}: the name must end in .json or .md")
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        # The trainers would resume from an earlier check's checkpoints and measure nothing.
        parser.error(f"--workdir {args.workdir} is not empty: give a new or empty folder")
    if args.plan:
        setup = Setup.cpu_smoke(args) if args.cpu_smoke else Setup.gpu(args)
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{PLAN_DEVICE} (assumed: no GPU here)"
        print(
            format_plan(
                plan_rows(setup, sections),
                args.budget_s,
                "CPU smoke (seconds: the H200 figures, not the smoke's)" if args.cpu_smoke else device,
            )
        )
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "error: no CUDA device visible to torch; run on a GPU machine, or pass --cpu-smoke for the CPU code paths",
            file=sys.stderr,
        )
        return 2
    setup = Setup.cpu_smoke(args) if args.cpu_smoke else Setup.gpu(args)
    budget = Budget(args.budget_s)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    folder = nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="gpu_check-")
    with folder as tmp:
        work = Path(tmp)
        rows: list[Row] = []
        if "preflight" in sections:
            run_section(rows, "preflight", preflight_rows, setup)
        if "train" in sections:
            train_sections(rows, setup, work, budget)
        flex_names = [f"flex_{p} T={T}" for T in setup.flex_lengths for p in ("fwd", "bwd")]
        rows += (budget.skip(flex_names, 30 if setup.cuda else 5) or []) if "flex" in sections else []
        if "flex" in sections and not any(r.check in flex_names for r in rows):
            run_section(rows, "flex_vs_dense", flex_rows, setup)
        resume = budget.skip(["resume_identical"], 60 if setup.cuda else 10) if "resume" in sections else None
        rows += resume or []
        if "resume" in sections and not resume:
            run_section(rows, "resume_identical", resume_rows, setup, work, budget)
        if "memory" in sections:
            run_section(rows, "memory", memory_rows, setup, budget)
        loss_names = [f"loss {k} T={n}" for n in setup.loss_lengths for k in ("chunked", "unfused")]
        rows += (budget.skip(loss_names, 20 if setup.cuda else 5) or []) if "loss" in sections else []
        if "loss" in sections and not any(r.check in loss_names for r in rows):
            run_section(rows, "loss", loss_rows, setup)
        rental_sections(rows, setup, work, budget, sections)
    meta = {
        "mode": "cpu-smoke" if args.cpu_smoke else "cuda",
        "device": torch.cuda.get_device_name(0) if setup.cuda else "CPU",
        "torch": torch.__version__,
        "seconds": time.monotonic() - START,
    }
    print(format_table(rows))
    for out in args.out:
        path = Path(out)
        if out.endswith(".json"):
            path.write_text(json.dumps(meta | {"rows": [asdict(r) for r in rows]}, indent=2) + "\n")
        else:
            path.write_text(format_markdown(rows, meta))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
