"""The recipe's `posttrain` section: one small frozen config per post-training step.

Each step receives only its own section (STYLE rule 4). Defaults are sized for the tiny recipe on
2 CPU cores; configs/smollm3-3b.yaml carries the published SmolLM3 numbers (SFT LR 2e-5, APO
`apo_zero` with beta 0.1 and LR 1e-6, merge 0.9 / 0.1). Training sizes are in optimizer steps
(`max_steps`), so a tiny run's cost is known before it starts.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_data_uri(uri: str) -> str:
    if uri == "builtin" or (uri.startswith(("files:", "hf:")) and uri.split(":", 1)[1]):
        return uri
    raise ValueError(
        f"unknown chat data {uri!r}; use 'builtin', 'files:GLOB' (JSONL with a messages field), "
        "'hf:NAME' (a hub dataset) or 'hf:/PATH' (a datasets.save_to_disk folder)"
    )


class ChatDataConfig(_Section):
    """Where the SFT conversations come from (`posttrain.data`)."""

    # builtin: conversations generated from the curated corpora (arithmetic with worked answers
    # from math, "summarise / continue this passage" from prose); files:GLOB, hf:NAME, hf:/PATH
    uri: str = "builtin"
    messages_field: str = "messages"  # column holding [{role, content}, ...] in files:/hf: data
    hf_subset: str | None = None  # hub dataset configuration (e.g. SmolTalk's "all")
    hf_split: str = "train"  # split to read from hf: data
    hf_revision: str | None = None  # pinned hub revision; pin it so caching means something
    max_examples: int | None = Field(default=None, gt=0)  # cap on conversations read
    math_examples: int = Field(default=600, ge=0)  # builtin: arithmetic conversations
    prose_examples: int = Field(default=150, ge=0)  # builtin: summarise/continue conversations
    heldout_examples: int = Field(default=64, ge=0)  # conversations kept for SFT eval loss
    held_out_fraction: float = Field(default=0.05, ge=0.0, lt=0.5)  # files:/hf: held-out share
    prompts: int = Field(default=256, ge=1)  # arithmetic prompts (with answers) for APO/GRPO/OPD

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return _check_data_uri(v)


class TrainerSection(_Section):
    """Knobs every TRL trainer shares."""

    max_steps: int = Field(default=20, gt=0)  # optimizer steps
    lr: float = Field(default=5e-4, gt=0)  # peak learning rate
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1)  # linear warmup share of the steps
    per_device_batch: int = Field(default=8, gt=0)  # sequences (or prompts) per device per step
    grad_accum: int = Field(default=1, gt=0)  # micro-batches per optimizer step
    bf16: bool = False  # bf16 mixed precision (GPU); the CPU recipe stays in float32
    gradient_checkpointing: bool = False  # recompute activations (3B on GPU), off for tiny


class SFTSection(TrainerSection):
    """`posttrain.sft`: TRL SFTTrainer, assistant-only loss, packing (SmolLM3: LR 2e-5)."""

    max_length: int = Field(default=256, gt=8)  # packed sequence length in tokens
    packing: bool = True  # best-fit-decreasing packing of whole conversations
    assistant_only_loss: bool = True  # loss on assistant turns only (template's generation marks)


class PreferenceSection(TrainerSection):
    """`posttrain.preference`: TRL DPOTrainer; SmolLM3 used APO-zero, beta 0.05-0.1, LR 1e-6."""

    enabled: bool = True
    loss_type: str = "apo_zero"  # any TRL DPO loss: sigmoid, ipo, apo_zero, apo_down, ...
    beta: float = Field(default=0.1, gt=0)  # strength of the implicit KL to the SFT reference
    lr: float = Field(default=5e-5, gt=0)  # ~10x below SFT
    max_length: int = Field(default=256, gt=8)  # prompt + completion tokens
    # self: pairs from the SFT model's own samples judged by the arithmetic verifier; or a
    # dataset with prompt/chosen/rejected (files:GLOB, hf:NAME, hf:/PATH)
    pairs: str = "self"
    pairs_subset: str | None = None  # dataset configuration of a hub pairs dataset
    pairs_split: str = "train"  # split of a pairs dataset (ultrafeedback_binarized: train_prefs)
    pairs_revision: str | None = None  # pinned hub revision of the pairs dataset
    max_pairs: int | None = Field(default=None, gt=0)  # cap on pairs read from a dataset
    samples_per_prompt: int = Field(default=4, ge=2)  # self: samples drawn per prompt
    max_new_tokens: int = Field(default=48, gt=0)  # self: sampled completion length
    temperature: float = Field(default=1.0, gt=0)  # self: sampling temperature

    @field_validator("pairs")
    @classmethod
    def _pairs(cls, v: str) -> str:
        return v if v == "self" else _check_data_uri(v)


class GRPOSection(TrainerSection):
    """`posttrain.grpo`: TRL GRPOTrainer with verifiable arithmetic rewards."""

    enabled: bool = True
    lr: float = Field(default=2e-5, gt=0)
    per_device_batch: int = Field(default=8, gt=0)  # completions per device per step
    num_generations: int = Field(default=4, ge=2)  # group size: completions per prompt
    beta: float = Field(default=0.04, ge=0)  # KL penalty to the reference (0 = no reference)
    max_completion_length: int = Field(default=48, gt=0)  # generated tokens per completion
    temperature: float = Field(default=1.0, gt=0)  # sampling temperature
    format_weight: float = Field(default=0.2, ge=0)  # weight of the format reward vs exact match
    save_steps: int = Field(default=5, gt=0)  # checkpoint interval: a crash resumes from here
    save_total_limit: int = Field(default=2, gt=0)  # checkpoints kept in the step folder

    @model_validator(mode="after")
    def _groups(self) -> GRPOSection:
        if (self.per_device_batch * self.grad_accum) % self.num_generations:
            raise ValueError(
                f"posttrain.grpo: per_device_batch x grad_accum = "
                f"{self.per_device_batch * self.grad_accum} must be a multiple of num_generations "
                f"= {self.num_generations} (whole groups per step)"
            )
        return self


class MergeSection(_Section):
    """`posttrain.merge`: linear merge of the post-trained and long-context base models."""

    enabled: bool = True
    # weights of (post-trained, long-context base), as SmolLM3: 0.9 x APO + 0.1 x mid-training
    weights: tuple[float, ...] = (0.9, 0.1)

    @field_validator("weights")
    @classmethod
    def _weights(cls, w: tuple[float, ...]) -> tuple[float, ...]:
        if len(w) < 2 or abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(f"posttrain.merge.weights must be 2+ numbers summing to 1, got {list(w)}")
        return w


class DistillSection(TrainerSection):
    """`posttrain.distill`: on-policy distillation from a teacher (runs only when one is named)."""

    teacher: str | None = None  # a local HF folder (or hub name) sharing our tokenizer
    lr: float = Field(default=5e-5, gt=0)
    beta: float = Field(default=1.0, ge=0, le=1)  # generalised JSD: 1.0 = reverse KL (on-policy)
    max_completion_length: int = Field(default=48, gt=0)  # student sample length
    temperature: float = Field(default=1.0, gt=0)


class PosttrainEvalConfig(_Section):
    """`posttrain.eval`: the post-training eval suite, scored after every step."""

    generation_items: int = Field(default=100, gt=0)  # held-out arithmetic exact-match items
    max_gen_tokens: int = Field(default=48, gt=0)  # tokens generated per answer
    # items per cloze task (regression check); fewer than the stages' suite, because every
    # post-training step is scored (the first items of the same held-out tasks)
    cloze_items: int = Field(default=100, gt=0)
    base: bool = True  # also score the pre-SFT base, so every step has a baseline row
    # lm-eval batch size of the post-training evaluations: larger than the stages' on CPU,
    # because batched greedy generation dominates their time
    batch_size: int = Field(default=32, gt=0)


class PosttrainConfig(_Section):
    """The recipe's `posttrain` section (docs/posttraining.md)."""

    data: ChatDataConfig = ChatDataConfig()
    sft: SFTSection = SFTSection()
    preference: PreferenceSection = PreferenceSection()
    merge: MergeSection = MergeSection()
    grpo: GRPOSection = GRPOSection()
    distill: DistillSection = DistillSection()
    eval: PosttrainEvalConfig = PosttrainEvalConfig()
    seed: int = 0  # seed of data order, sampling and trainers
    device: Literal["auto", "cpu", "cuda"] = "auto"  # cuda when available under "auto"


S = TypeVar("S", bound=BaseModel)


class TrainerRun(_Section, Generic[S]):
    """A post-training step's config: its own section, plus the post-training seed and device."""

    section: S
    seed: int = 0  # posttrain.seed
    device: Literal["auto", "cpu", "cuda"] = "auto"  # posttrain.device

    @classmethod
    def of(cls, section: S, posttrain: PosttrainConfig) -> TrainerRun[S]:
        return cls[type(section)](section=section, seed=posttrain.seed, device=posttrain.device)


class ChatDataSpec(_Section):
    """The posttrain_data step's config: the data section and the post-training seed."""

    data: ChatDataConfig
    seed: int = 0
