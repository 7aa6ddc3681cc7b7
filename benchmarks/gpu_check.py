"""The GPU check: one prepared run of every CUDA path of this project, printed as one table.

    python benchmarks/gpu_check.py                             # a CUDA machine, < 8 min on 1 H200
    python benchmarks/gpu_check.py --out gpu_check.md --out gpu_check.json
    python benchmarks/gpu_check.py --cpu-smoke                 # same code paths, toy size, CPU

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
  logits path.

`--cpu-smoke` runs the same functions at toy size on CPU, where the trainer's "auto" precision is
fp32 and its "auto" attention the dense SDPA mask (FlexAttention has no CPU backward), and memory
is measured with torch's MemTracker: the preflight rows that need CUDA, the flex backward rows and
the throughput judgement SKIP, each with its reason.
A time budget (--budget-s) turns the rows it would overrun into named SKIPs. Exit status: 1 if any
row FAILs, else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
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
    args = parser.parse_args(argv)
    for out in args.out:
        if not out.endswith((".json", ".md")):
            parser.error(f"--out {out}: the name must end in .json or .md")
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        # The trainers would resume from an earlier check's checkpoints and measure nothing.
        parser.error(f"--workdir {args.workdir} is not empty: give a new or empty folder")
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
        run_section(rows, "preflight", preflight_rows, setup)
        # Rough needs: the 1B trainer compiles (~2 min) and runs its steps; the rest is small.
        ours_names = ["train_ours", "train_transformers", "ratio_vs_transformers"]
        skipped = budget.skip(ours_names, 60 if setup.cuda else 10)
        ours: dict = {}
        if skipped:
            rows += skipped
        else:

            def train_ours() -> list[Row]:
                section, figures = ours_rows(setup, work, budget)
                ours.update(figures)
                return section

            run_section(rows, "train_ours", train_ours)
            if ours.get("tokens_per_s"):
                run_section(rows, "train_transformers", transformers_rows, setup, ours)
                if ours.get("hf_tokens_per_s"):
                    rows += ratio_rows(setup, ours)
                else:
                    rows.append(Row("ratio_vs_transformers", "SKIP", detail="transformers row failed"))
            else:
                rows += [Row(n, "SKIP", detail="train_ours failed") for n in ours_names[1:]]
        flex_names = [f"flex_{p} T={T}" for T in setup.flex_lengths for p in ("fwd", "bwd")]
        rows += budget.skip(flex_names, 30 if setup.cuda else 5) or []
        if not any(r.check in flex_names for r in rows):
            run_section(rows, "flex_vs_dense", flex_rows, setup)
        resume = budget.skip(["resume_identical"], 60 if setup.cuda else 10)
        rows += resume or []
        if not resume:
            run_section(rows, "resume_identical", resume_rows, setup, work, budget)
        run_section(rows, "memory", memory_rows, setup, budget)
        loss_names = [f"loss {k} T={n}" for n in setup.loss_lengths for k in ("chunked", "unfused")]
        rows += budget.skip(loss_names, 20 if setup.cuda else 5) or []
        if not any(r.check in loss_names for r in rows):
            run_section(rows, "loss", loss_rows, setup)
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
