"""The recipe's `posttrain` section: one small frozen config per post-training step.

Each step receives only its own section (a component is handed its own config, never the whole
recipe). Defaults are sized for the tiny recipe on
2 CPU cores; configs/smollm3-3b.yaml carries the published SmolLM3 numbers (SFT LR 2e-5, APO
`apo_zero` with beta 0.05-0.1 and LR 1e-6, merge 0.9 x APO soup + 0.1 x mid-training). Training
sizes are in optimizer steps (`max_steps`) of `batch` sequences over all ranks, so a run's cost is
known before it starts and does not depend on how many ranks run it: `per_device_batch` and the
world size only decide the gradient accumulation (operational fields).

Where the trainers run is `posttrain.launch` over the recipe's `launch` section: the same
launchers as the pretraining stages (local torchrun, Slurm, Kubernetes), optionally through
`accelerate launch` with an accelerate config file (FSDP, DeepSpeed ZeRO).
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.launchers import LaunchConfig
from infra.storage import StorageConfig
from model.spec import TrackerConfig
from pipeline.artifact import added_identity, operational

# transformers' `set_seed` seeds numpy's legacy generator, which takes a 32-bit seed
SEED_MAX = 2**32 - 1


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_data_uri(uri: str) -> str:
    if uri == "builtin" or (uri.startswith(("files:", "hf:")) and uri.split(":", 1)[1]):
        return uri
    raise ValueError(
        f"unknown chat data {uri!r}; use 'builtin', 'files:GLOB' (JSONL with a messages field), "
        "'hf:NAME' (a hub dataset) or 'hf:/PATH' (a datasets.save_to_disk folder)"
    )


# Strings the chat template reads as structure: a system turn holding one would not be one turn.
_TURN_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")


class ReasoningModesConfig(_Config):
    """The recipe's `reasoning_modes`: the system turn of each reasoning mode in the built-in chat
    data, the one place the reasoning traces (`reasoning_data`), the SFT conversations and RL
    prompts (`posttrain_data`), the preference prompts (`preference_pairs`) and the post-training
    eval prompts (`eval_suite`) take it from, so a model is scored on the prompt it was trained on.
    Each is rendered by the dual-mode chat template (curation/bpe.py): the flag picks the mode and
    the rest becomes the turn's custom instructions (none: the template's default ones)."""

    # think mode: short instructions, not the template's ~1,100-character default ones, which
    # would fill the tiny recipe's 256-token SFT rows
    think_system: str = "Think step by step, then answer. /think"
    no_think_system: str = "/no_think"  # no-think mode: the template's short default instructions

    @model_validator(mode="after")
    def _flags(self) -> ReasoningModesConfig:
        for field, flag in (("think_system", "/think"), ("no_think_system", "/no_think")):
            text = getattr(self, field)
            marker = next((m for m in _TURN_MARKERS if m in text), None)
            if marker is not None:
                raise ValueError(f"reasoning_modes.{field} holds {marker!r}, a chat-template marker; remove it")
            if flag not in text:
                raise ValueError(
                    f"reasoning_modes.{field} {text!r} does not say {flag}: the template picks the mode "
                    f"from that flag; add it (e.g. {(text.strip() + ' ' + flag).strip()!r})"
                )
        if "/no_think" in self.think_system:  # the template's /no_think wins over /think
            raise ValueError(f"reasoning_modes.think_system {self.think_system!r} says /no_think: remove it")
        return self

    def system(self, mode: str) -> str:
        """The system turn's content for `mode` ("think" or "no_think")."""
        if mode not in ("think", "no_think"):
            raise ValueError(f"unknown reasoning mode {mode!r}; use think or no_think")
        return self.think_system if mode == "think" else self.no_think_system


class ChatDataConfig(_Config):
    """Where the SFT conversations come from (`posttrain.data`)."""

    # builtin: conversations generated from the curated corpora (arithmetic with worked answers
    # from math, "summarise / continue this passage" from prose); files:GLOB, hf:NAME, hf:/PATH
    uri: str = "builtin"
    messages_field: str = "messages"  # column holding [{role, content}, ...] in files:/hf: data
    hf_subset: str | None = None  # hub dataset configuration (e.g. SmolTalk's "all")
    # split to read from hf: data; a list is read as one split, joined with "+" as `datasets`
    # does (`a+b[:50%]`: all of a, the first half of b), e.g. SmolTalk2's SFT subsets
    hf_split: str = "train"
    hf_revision: str | None = None  # pinned hub revision; pin it so caching means something
    max_examples: int | None = Field(default=None, gt=0)  # cap on conversations read
    math_examples: int = Field(default=600, ge=0)  # builtin: arithmetic conversations
    prose_examples: int = Field(default=150, ge=0)  # builtin: summarise/continue conversations
    # builtin: share of arithmetic conversations answered in think mode (a worked trace in
    # <think>...</think>); the others, and every prose one, answer directly (/no_think)
    think_share: float = Field(default=0.0, ge=0.0, le=1.0)
    heldout_examples: int = Field(default=64, ge=0)  # conversations kept for SFT eval loss
    held_out_fraction: float = Field(default=0.05, ge=0.0, lt=0.5)  # files:/hf: held-out share
    prompts: int = Field(default=256, ge=1)  # arithmetic prompts (with answers) for APO/GRPO/OPD

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return _check_data_uri(v)

    @field_validator("hf_split", mode="before")
    @classmethod
    def _splits(cls, v: object) -> object:
        if isinstance(v, list | tuple):
            if not v or not all(isinstance(s, str) and s.strip() for s in v):
                raise ValueError(f"posttrain.data.hf_split: a list must hold split names, got {v!r}")
            return "+".join(s.strip() for s in v)
        return v


def micro_batches(batch: int, per_device_max: int, world: int, what: str = "batch") -> tuple[int, int]:
    """(sequences per rank per forward, accumulation steps) that make `batch` on `world` ranks:
    the fewest accumulation steps whose micro-batch fits in `per_device_max`."""
    if batch % world:
        raise ValueError(
            f"{what} {batch} is not divisible by the {world} ranks of posttrain.launch (nodes x "
            "procs_per_node): every rank takes the same share of an optimizer step; change the "
            "batch or the number of ranks"
        )
    per_rank = batch // world
    accum = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= per_device_max)
    return per_rank // accum, accum


class TrainerConfig(_Config):
    """Knobs every TRL trainer shares."""

    max_steps: int = Field(default=20, gt=0)  # optimizer steps
    lr: float = Field(default=5e-4, gt=0)  # peak learning rate
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1)  # linear warmup share of the steps
    # sequences per optimizer step over all ranks (SFT: packed rows; preference: pairs; GRPO:
    # completions; distillation: prompts): the same on 1 CPU process or 64 GPUs
    batch: int = Field(default=8, gt=0)
    # at most this many sequences per rank per forward pass; gradient accumulation makes up
    # `batch` (accumulation = batch / (ranks x micro-batch))
    per_device_batch: int = operational(8, gt=0)
    bf16: bool = False  # bf16 mixed precision (GPU); the CPU recipe stays in float32
    gradient_checkpointing: bool = False  # recompute activations (3B on GPU), off for tiny
    save_steps: int = operational(10, gt=0)  # checkpoint interval: a killed run resumes from the newest
    keep_checkpoints: int = operational(2, gt=0)  # complete checkpoints kept besides the final one


class SFTConfig(TrainerConfig):
    """`posttrain.sft`: TRL SFTTrainer, assistant-only loss, packing (SmolLM3: LR 2e-5)."""

    max_length: int = Field(default=256, gt=8)  # packed sequence length in tokens
    packing: bool = True  # best-fit-decreasing packing of whole conversations
    assistant_only_loss: bool = True  # loss on assistant turns only (template's generation marks)


class PreferenceConfig(TrainerConfig):
    """`posttrain.preference`: TRL DPOTrainer; SmolLM3 used APO-zero, beta 0.05-0.1, LR 1e-6."""

    enabled: bool = True
    loss_type: str = "apo_zero"  # any TRL DPO loss: sigmoid, ipo, apo_zero, apo_down, ...
    beta: float = Field(default=0.1, gt=0)  # strength of the implicit KL to the SFT reference
    lr: float = Field(default=5e-5, gt=0)  # ~10x below SFT
    max_length: int = Field(default=256, gt=8)  # prompt + completion tokens
    # self: pairs from the SFT model's own samples judged by the arithmetic verifier; on_policy:
    # the pairs of the preference_pairs step (`posttrain.pairs`: per mode, the policy's answer
    # against a stronger source's); or a dataset with prompt/chosen/rejected (files:GLOB, hf:NAME,
    # hf:/PATH)
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
        return v if v in ("self", "on_policy") else _check_data_uri(v)


PAIR_SIDES = ("reference", "policy")  # besides `model:NAME`


def _check_side(v: str) -> str:
    if v in PAIR_SIDES or (v.startswith("model:") and v[6:]):
        return v
    raise ValueError(
        f"unknown pair source {v!r}; use 'reference' (the verified worked answer of a builtin "
        "prompt), 'policy' (the model being post-trained) or 'model:NAME' (a local HF folder or a "
        "hub model, e.g. model:Qwen/Qwen3-32B)"
    )


class PairModeConfig(_Config):
    """One reasoning mode's preference pairs (`posttrain.pairs.think`, `posttrain.pairs.no_think`):
    on the same prompts, a chosen answer from a stronger source and a rejected one (by default the
    policy's own), or the pairs of a dataset."""

    # builtin: posttrain_data's arithmetic prompts (known answers, worked reference solutions);
    # or a files:GLOB / hf:NAME / hf:/PATH dataset whose `prompt_field` holds the prompt
    prompts: str = "builtin"
    prompt_field: str = "prompt"  # column of a prompts dataset: a string or a message list
    # instead of sampling: a dataset of prompt/chosen/rejected rows (files:/hf:), e.g. Tulu 3's
    # preference mixture for no-think mode; `prompts`, `chosen` and `rejected` are then unused
    pairs: str | None = None
    hf_subset: str | None = None  # dataset configuration of the prompts or pairs dataset
    hf_split: str = "train"  # split of the prompts or pairs dataset
    hf_revision: str | None = None  # pinned hub revision of that dataset; pin it so caching means something
    max_prompts: int = Field(default=8, gt=0)  # prompts answered (or dataset rows read) for this mode
    # who answers: reference (the builtin prompt's verified answer; in think mode with its worked
    # trace), policy (the model being post-trained, the SFT model) or model:NAME (a local HF
    # folder or hub model with a chat template, sampled in this mode with `enable_thinking`)
    chosen: str = "reference"
    rejected: str = "policy"
    max_new_tokens: int = Field(default=64, gt=0)  # tokens per sampled answer
    temperature: float = Field(default=0.0, ge=0)  # 0: greedy; else seeded sampling
    batch_size: int = operational(16, gt=0)  # prompts per generate call
    # generate calls per chunk: each chunk's pairs are written to disk before the next is generated
    # (memory bounded by a chunk; a killed attempt resumes from the chunks written)
    chunk_batches: int = operational(32, gt=0)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: str) -> str:
        return v if v == "builtin" else _check_data_uri(v)

    @field_validator("pairs")
    @classmethod
    def _pairs_uri(cls, v: str | None) -> str | None:
        return None if v is None else _check_data_uri(v)

    @field_validator("chosen", "rejected")
    @classmethod
    def _side(cls, v: str) -> str:
        return _check_side(v)

    @model_validator(mode="after")
    def _sides(self) -> PairModeConfig:
        if self.pairs is not None:
            return self
        if self.chosen == self.rejected:
            raise ValueError(f"posttrain.pairs: chosen and rejected are both {self.chosen!r}; a pair needs two sources")
        if self.rejected == "reference":
            raise ValueError(
                "posttrain.pairs: rejected 'reference' would reject the verified answer; use policy or model:NAME"
            )
        if self.chosen == "reference" and self.prompts != "builtin":
            raise ValueError(
                f"posttrain.pairs: chosen 'reference' needs the builtin prompts (they carry verified "
                f"answers), not {self.prompts!r}; name a chosen model:NAME"
            )
        return self


class PairsConfig(_Config):
    """`posttrain.pairs`: the preference_pairs step, one section per reasoning mode (a mode left
    unset gets no pairs). `posttrain.preference.pairs: on_policy` trains APO on its pairs."""

    think: PairModeConfig | None = None  # pairs whose prompt renders in /think mode
    no_think: PairModeConfig | None = None  # pairs whose prompt renders in /no_think mode

    def modes(self) -> dict[str, PairModeConfig]:
        """The configured modes, think first."""
        return {m: c for m, c in (("think", self.think), ("no_think", self.no_think)) if c is not None}


class PairsSpec(_Config):
    """The preference_pairs step's config: the pairs section, the post-training seed and device,
    and the recipe's `reasoning_modes` (the system turns of builtin prompts)."""

    pairs: PairsConfig
    seed: int = 0  # posttrain.seed: prompt order and sampling
    device: Literal["auto", "cpu", "cuda"] = "auto"  # posttrain.device
    modes: ReasoningModesConfig = added_identity(ReasoningModesConfig())  # out of the fingerprint at the default


class SoupConfig(_Config):
    """One more preference run for the soup (`posttrain.merge.soup[]`): the main preference
    section with the fields named here changed."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")  # its label (preference[NAME], evaluate[NAME])
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)  # posttrain seed of this run (data order, pairs)
    beta: float | None = Field(default=None, gt=0)  # APO/DPO beta (SmolLM3: 0.05-0.1)
    lr: float | None = Field(default=None, gt=0)  # learning rate
    loss_type: str | None = None  # TRL DPO loss
    max_steps: int | None = Field(default=None, gt=0)  # optimizer steps

    def apply(self, section: PreferenceConfig) -> PreferenceConfig:
        changes = {k: v for k, v in self.model_dump(exclude={"name", "seed"}).items() if v is not None}
        return PreferenceConfig.model_validate({**section.model_dump(), **changes})


class GRPOConfig(TrainerConfig):
    """`posttrain.grpo`: TRL GRPOTrainer with verifiable arithmetic rewards."""

    enabled: bool = True
    lr: float = Field(default=2e-5, gt=0)
    num_generations: int = Field(default=4, ge=2)  # group size: completions per prompt
    beta: float = Field(default=0.04, ge=0)  # KL penalty to the reference (0 = no reference)
    max_completion_length: int = Field(default=48, gt=0)  # generated tokens per completion
    temperature: float = Field(default=1.0, gt=0)  # sampling temperature
    format_weight: float = Field(default=0.2, ge=0)  # weight of the format reward vs exact match
    # The RL prompt pool: the first N of posttrain_data's prompts (None: all), which max_steps x
    # batch / num_generations prompt draws go over for as many epochs as that makes; out of the
    # fingerprint while unset, so the GRPO steps of workspaces built before it are reused
    prompts: int | None = added_identity(None, gt=0)
    save_steps: int = operational(5, gt=0)  # checkpoint interval: a killed run resumes from here

    @model_validator(mode="after")
    def _groups(self) -> GRPOConfig:
        if self.batch % self.num_generations:
            raise ValueError(
                f"posttrain.grpo: batch {self.batch} (completions per step) must be a multiple of "
                f"num_generations = {self.num_generations} (whole groups per step)"
            )
        return self


class SAOConfig(TrainerConfig):
    """`posttrain.sao`: single-rollout asynchronous RL (trainers/posttrain/sao.py), on the GRPO
    prompts and rewards. One completion per prompt, generated by separate rollout processes that
    stream samples through a bounded queue; a decoupled PPO objective (AReaL) corrects for the
    policy lag, and a value model (VAPO-style GAE) is the baseline instead of a group mean.
    `max_steps` counts policy updates (one batch each), after `value_warmup` value-only batches."""

    enabled: bool = False
    lr: float = Field(default=2e-5, gt=0)  # policy learning rate
    value_lr: float = Field(default=1e-4, gt=0)  # value model learning rate
    batch: int = Field(default=8, gt=0)  # accepted samples (one completion per prompt) per update
    value_warmup: int = Field(default=2, ge=0)  # value-only batches before the first policy update
    epochs: int = Field(default=2, gt=0)  # optimizer passes over each batch (clipping acts from the 2nd)
    clip: float = Field(default=0.2, gt=0, lt=1)  # PPO clip of current / proximal policy ratio
    is_cap: float = Field(default=5.0, ge=1)  # truncation of the behaviour -> proximal importance weight
    max_staleness: int = Field(default=2, ge=0)  # samples from older policy versions are dropped
    push_every: int = Field(default=1, gt=0)  # policy updates between weight pushes to the rollouts
    queue_size: int = Field(default=16, gt=0)  # samples the rollouts may run ahead of the trainer
    gamma: float = Field(default=1.0, gt=0, le=1)  # discount per token
    lam_value: float = Field(default=1.0, ge=0, le=1)  # GAE lambda of the value targets (VAPO: 1)
    lam_policy: float = Field(default=0.95, ge=0, le=1)  # GAE lambda of the policy advantages
    max_completion_length: int = Field(default=48, gt=0)  # generated tokens per completion
    temperature: float = Field(default=1.0, gt=0)  # sampling temperature (behaviour and training)
    format_weight: float = Field(default=0.2, ge=0)  # weight of the format reward vs exact match
    # rollout processes per node, each generating every n-th sample: on the trainer's node
    # (rollout_nodes 0), or on each node of the rollout pool
    rollout_workers: int = operational(1, gt=0)
    rollout_threads: int = operational(1, gt=0)  # CPU threads per rollout process
    # 0: the rollout workers run beside the trainer, started by it; N > 0: a separate rollout job
    # of N nodes on the step's launcher (a Slurm job, a Kubernetes Indexed Job, local processes;
    # infra/launchers/pool.py) meeting the trainer in the step folder on the shared file system;
    # the trainer starts no worker then
    rollout_nodes: int = operational(0, ge=0)
    # the trainer stops with an error naming the pool's job when no sample came for this long
    # (a pool that never starts, hangs or keeps failing); 0 rollout_nodes: not used
    rollout_timeout_s: float = operational(900.0, gt=0)
    # how the rollouts generate: transformers `generate`; vllm (the optional [vllm] extra, GPU
    # nodes; an error when it does not import); auto: vllm where it imports and a GPU is visible.
    # The same sampling distribution either way: which one runs is not part of the step's identity
    engine: Literal["transformers", "vllm", "auto"] = operational("transformers")
    save_steps: int = operational(5, gt=0)  # checkpoint interval in trainer steps (warmup included)


def _check_weights(w: tuple[float, ...], field: str, n: int | None = None) -> tuple[float, ...]:
    if (n is not None and len(w) != n) or len(w) < 2 or any(x < 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
        size = f"{n} " if n is not None else "2+ "
        raise ValueError(f"posttrain.merge.{field} must be {size}non-negative numbers summing to 1, got {list(w)}")
    return w


class MergeConfig(_Config):
    """`posttrain.merge`, the SmolLM3 way: a soup (weighted average) of preference-trained
    models, then a linear merge of the soup with a mid-training or long-context checkpoint."""

    enabled: bool = True
    # more preference runs for the soup, each the main `posttrain.preference` run with a few
    # fields changed (seed, beta, lr, ...); the soup averages the main run and these. Empty: no
    # soup, the preference model itself is merged
    soup: tuple[SoupConfig, ...] = ()
    # soup weights, the main preference run first then `soup` in order; None: uniform
    soup_weights: tuple[float, ...] | None = None
    # the pretraining or long-context stage whose export is merged with the soup (SmolLM3: a
    # mid-training checkpoint with strong long context); None: the model post-training started from
    stage: str | None = None
    # weights of (soup, that checkpoint), as SmolLM3: 0.9 x APO soup + 0.1 x mid-training
    weights: tuple[float, ...] = (0.9, 0.1)

    @field_validator("weights")
    @classmethod
    def _weights(cls, w: tuple[float, ...]) -> tuple[float, ...]:
        return _check_weights(w, "weights", 2)

    @model_validator(mode="after")
    def _soup(self) -> MergeConfig:
        names = [r.name for r in self.soup]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"posttrain.merge.soup names must be unique; repeated: {', '.join(dupes)}")
        if self.soup_weights is not None:
            if not self.soup:
                raise ValueError(
                    "posttrain.merge.soup_weights is set but posttrain.merge.soup is "
                    "empty: list the extra preference runs of the soup"
                )
            _check_weights(self.soup_weights, "soup_weights", len(self.soup) + 1)
        return self

    def soup_mix(self) -> tuple[float, ...]:
        """The soup's weights: the main preference run first, then `soup` in order."""
        n = len(self.soup) + 1
        return self.soup_weights if self.soup_weights is not None else tuple(1.0 / n for _ in range(n))


class MergeSpec(_Config):
    """The merge step's config: one weight per model of its `models` input, in order."""

    weights: tuple[float, ...]

    @field_validator("weights")
    @classmethod
    def _weights(cls, w: tuple[float, ...]) -> tuple[float, ...]:
        return _check_weights(w, "weights")


class DistillConfig(TrainerConfig):
    """`posttrain.distill`: on-policy distillation from a teacher (runs only when one is named)."""

    teacher: str | None = None  # a local HF folder (or hub name) sharing our tokenizer
    lr: float = Field(default=5e-5, gt=0)
    beta: float = Field(default=1.0, ge=0, le=1)  # generalised JSD: 1.0 = reverse KL (on-policy)
    max_completion_length: int = Field(default=48, gt=0)  # student sample length
    temperature: float = Field(default=1.0, gt=0)


class PosttrainEvalConfig(_Config):
    """`posttrain.eval`: the post-training eval suite, scored after every step."""

    generation_items: int = Field(default=100, gt=0)  # held-out arithmetic exact-match items
    max_gen_tokens: int = Field(default=48, gt=0)  # tokens generated per answer
    # tokens per think-mode answer (its <think> block and the answer; 0: no think-mode task)
    think_gen_tokens: int = Field(default=256, ge=0)
    # items per cloze task (regression check); fewer than the stages' suite, because every
    # post-training step is scored (the first items of the same held-out tasks)
    cloze_items: int = Field(default=100, gt=0)
    base: bool = True  # also score the pre-SFT base, so every step has a baseline row
    # also score, on the same suite, the export of the stage the reasoning stages started from,
    # so the report says whether reasoning mid-training moved exact match (`base vs
    # before-reasoning`); refused when the recipe's last stage is not a reasoning stage
    before_reasoning: bool = False
    # lm-eval batch size of the post-training evaluations: larger than the stages' on CPU,
    # because batched greedy generation dominates their time
    batch_size: int = Field(default=32, gt=0)


class PosttrainLaunchConfig(_Config):
    """`posttrain.launch`: where the post-training trainers run. Unset fields come from the
    recipe's `launch` section (kind, Slurm/Kubernetes settings, env) and `training.nproc_per_node`."""

    nodes: int | None = Field(default=None, gt=0)  # machines; None: launch.nodes
    procs_per_node: int | None = Field(default=None, gt=0)  # ranks per node; None: training.nproc_per_node
    gpus_per_node: int | None = Field(default=None, ge=0)  # GPUs per node; None: launch.gpus_per_node
    # accelerate config file (FSDP / DeepSpeed ZeRO / bf16) the launcher passes to `accelerate
    # launch`; relative to the checkout. None: plain torchrun (DDP)
    accelerate_config: str | None = None
    env: dict[str, str] = {}  # extra environment over launch.env; never credentials

    @field_validator("env")
    @classmethod
    def _no_credentials(cls, env: dict[str, str]) -> dict[str, str]:
        from pydantic import ValidationError

        try:
            LaunchConfig(env=env)  # the launcher's own rule, said for this section
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"posttrain.{msg}") from None
        return env

    def resolve(self, launch: LaunchConfig, procs_per_node: int) -> LaunchConfig:
        """The recipe's launcher with these settings over it, running `trainers.posttrain`."""
        return LaunchConfig.model_validate(
            {
                **launch.model_dump(),
                "nodes": self.nodes or launch.nodes,
                "procs_per_node": self.procs_per_node or procs_per_node,
                "gpus_per_node": launch.gpus_per_node if self.gpus_per_node is None else self.gpus_per_node,
                "accelerate_config": self.accelerate_config,
                "env": {**launch.env, **self.env},
                "module": "trainers.posttrain",
            }
        )


class PosttrainConfig(_Config):
    """The recipe's `posttrain` section (docs/posttraining.md)."""

    launch: PosttrainLaunchConfig = operational(PosttrainLaunchConfig())  # nodes, ranks, accelerate config
    data: ChatDataConfig = ChatDataConfig()
    sft: SFTConfig = SFTConfig()
    preference: PreferenceConfig = PreferenceConfig()
    pairs: PairsConfig = PairsConfig()  # on-policy preference pairs per mode (preference.pairs: on_policy)
    merge: MergeConfig = MergeConfig()
    grpo: GRPOConfig = GRPOConfig()
    sao: SAOConfig = SAOConfig()  # off unless enabled (tiny: on)
    distill: DistillConfig = DistillConfig()
    eval: PosttrainEvalConfig = PosttrainEvalConfig()
    seed: int = Field(default=0, ge=0, le=SEED_MAX)  # seed of data order, sampling and trainers
    device: Literal["auto", "cpu", "cuda"] = "auto"  # cuda when available under "auto"

    @model_validator(mode="after")
    def _grpo_pool_fits(self) -> PosttrainConfig:
        if self.grpo.prompts is not None and self.grpo.prompts > self.data.prompts:
            raise ValueError(
                f"posttrain.grpo.prompts = {self.grpo.prompts} is more than the "
                f"posttrain.data.prompts = {self.data.prompts} arithmetic prompts the data step writes"
            )
        return self

    @model_validator(mode="after")
    def _soup_needs_preference(self) -> PosttrainConfig:
        if self.merge.enabled and self.merge.soup and not self.preference.enabled:
            raise ValueError("posttrain.merge.soup lists preference runs but posttrain.preference.enabled is false")
        if self.preference.enabled and self.preference.pairs == "on_policy" and not self.pairs.modes():
            raise ValueError(
                "posttrain.preference.pairs is 'on_policy' but posttrain.pairs names no mode; set "
                "posttrain.pairs.think and/or posttrain.pairs.no_think"
            )
        taken = {
            "base",
            "sft",
            "soup",
            "merge",
            "grpo",
            "sao",
            "opd",
            "chat",
            "pairs",
            "posttrain",
            self.preference.loss_type.split("_")[0]
            if self.preference.loss_type.startswith("apo")
            else self.preference.loss_type,
        }
        clash = sorted(r.name for r in self.merge.soup if r.name in taken)
        if clash:
            raise ValueError(
                f"posttrain.merge.soup name(s) {', '.join(clash)} are labels of other "
                f"post-training steps ({', '.join(sorted(taken))}); pick others"
            )
        return self


S = TypeVar("S", bound=BaseModel)
SECTIONS = {
    SFTConfig: "sft",
    PreferenceConfig: "preference",
    GRPOConfig: "grpo",
    SAOConfig: "sao",
    DistillConfig: "distill",
}


class PosttrainSpec(_Config, Generic[S]):
    """A post-training step's config: its own section, the post-training seed and device, and
    where its trainer runs (operational: the launcher, the S3 mirror, CPU threads per rank)."""

    section: S
    seed: int = 0  # posttrain.seed
    device: Literal["auto", "cpu", "cuda"] = "auto"  # posttrain.device
    launch: LaunchConfig = operational(LaunchConfig(module="trainers.posttrain"))  # posttrain.launch over launch
    storage: StorageConfig = operational(StorageConfig())  # S3 mirror of the trainer's checkpoints
    threads: int | None = operational(None, gt=0)  # CPU threads per rank (the train slot's)
    tracker: TrackerConfig = operational(TrackerConfig(kind="none"))  # training.tracker: the trainer's curves

    @model_validator(mode="after")
    def _batch_fits_the_ranks(self) -> PosttrainSpec[S]:
        if self.launch.module != "trainers.posttrain":
            raise ValueError(f"a post-training launch runs -m trainers.posttrain, not {self.launch.module}")
        self.micro_batches()  # a batch that the ranks cannot share fails before anything runs
        return self

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    def micro_batches(self) -> tuple[int, int]:
        """(sequences per rank per forward, gradient accumulation steps) on this launch."""
        s = self.section
        return micro_batches(
            s.batch, s.per_device_batch, self.world_size, f"posttrain.{SECTIONS.get(type(s), 'section')}.batch"
        )

    def launch_summary(self) -> str:
        """Where and how the trainer runs, for plans and logs."""
        micro, accum = self.micro_batches()
        ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
        pool = ""
        if isinstance(self.section, SAOConfig) and self.section.rollout_nodes:
            s = self.section
            pool = f"; rollout pool: {s.rollout_nodes} node(s) x {s.rollout_workers} worker(s), {s.engine}"
        return f"{self.launch.describe()}; batch {self.section.batch} = {ranks} x {micro} x {accum} accumulation{pool}"

    @classmethod
    def of(
        cls,
        section: S,
        posttrain: PosttrainConfig,
        *,
        launch: LaunchConfig | None = None,
        storage: StorageConfig | None = None,
        threads: int | None = None,
        seed: int | None = None,
        tracker: TrackerConfig | None = None,
    ) -> PosttrainSpec[S]:
        return cls[type(section)](
            section=section,
            seed=posttrain.seed if seed is None else seed,
            device=posttrain.device,
            launch=launch or LaunchConfig(module="trainers.posttrain"),
            storage=storage or StorageConfig(),
            threads=threads,
            tracker=tracker or TrackerConfig(kind="none"),
        )


class ChatDataSpec(_Config):
    """The posttrain_data step's config: the data section, the post-training seed and the
    recipe's `reasoning_modes` (the system turns of the builtin conversations and prompts)."""

    data: ChatDataConfig
    seed: int = 0
    modes: ReasoningModesConfig = added_identity(ReasoningModesConfig())  # out of the fingerprint at the default
