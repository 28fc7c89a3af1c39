"""Pipeline configuration: one pydantic tree, loadable from YAML, with every field documented.

Unknown fields are rejected everywhere (`extra="forbid"`) so a typo in a YAML file is an error, not a silent default.
The defaults describe the built-in demo: a tiny char-level model learning single-digit sums (task `sum`) on CPU in
minutes, from a mean sampled reward of ~0.3 to ~0.85 (bench/learning_curve.py measures it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlpipe.config_checks import check_consistency
from rlpipe.errors import ConfigError
from rlpipe.io import NAME_PATTERN, check_name
from rlpipe.models.lora import LoRAConfig
from rlpipe.models.tiny import TinyModelConfig

SEED_LIMIT = 2**63
"""Seeds are 0 <= seed < 2**63: numpy's SeedSequence refuses negatives and torch.manual_seed anything >= 2**64
(measured: `Overflow when unpacking long long`); the headroom keeps `seed + rank` and the other offsets in range."""


class _Strict(BaseModel):
    # allow_inf_nan=False: a NaN/inf float is never a useful setting, and inf would not survive the JSON trip to
    # the workers (pydantic writes it as null).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Strict):
    """Which policy to train and how to load it."""

    path: str | None = Field(
        None, description="Local HF model directory (config.json + weights + tokenizer). None builds the tiny default."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of the policy.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model directory. Off by default.")
    attn_implementation: str = Field(
        "sdpa", description="transformers attention backend (sdpa, eager, flash_attention_2)."
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the tiny default model.")
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="LoRA adapters (peft): train only them; the KL reference is the base (adapters off); a vLLM "
        "engine is synced with the adapter alone.",
    )
    warmup_sft_steps: int = Field(
        180,
        ge=0,
        description="SFT steps on the built-in task's demonstrations when the tiny default model is first built, so RL "
        "starts from a policy that sometimes succeeds (RL from random weights has no reward signal). The default leaves "
        "the tiny model at ~0.26 sampled reward on `sum`, so the run shows what RL adds.",
    )
    warmup_sft_batch_size: int = Field(32, ge=1, description="Sequences per warm-up SFT step.")
    warmup_sft_lr: float = Field(1e-3, gt=0, description="Learning rate of the warm-up SFT.")


class DataConfig(_Strict):
    """Prompt data: a built-in synthetic task or a user parquet/jsonl file (verl-style columns)."""

    task: str | None = Field(
        "sum", description="Built-in task name (sum, count, reverse, add, mix); ignored if path set."
    )
    path: str | None = Field(None, description="Prompt dataset file (.parquet or .jsonl); overrides `task`.")
    num_prompts: int = Field(2000, ge=1, description="Number of prompts generated for a built-in task.")
    eval_path: str | None = Field(None, description="Held-out prompt file for `evaluate`; built-in tasks generate one.")
    num_eval_prompts: int = Field(64, ge=1, description="Held-out prompts generated for a built-in task.")
    max_prompt_length: int = Field(64, ge=1, description="Prompts longer than this (in tokens) are an error.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (chat messages or text).")
    apply_chat_template: bool = Field(True, description="Wrap prompts in the tokenizer's chat template.")
    seed: int = Field(
        0, ge=0, lt=SEED_LIMIT, description="Seed of the built-in task generator and of the prompt sampler's shuffle."
    )

    @field_validator("task")
    @classmethod
    def _task_is_a_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "data.task")


class SFTConfig(_Strict):
    """Periodic SFT steps mixed into RL (the seed's `rollout_steps_per_sft`)."""

    enabled: bool = Field(False, description="Run one SFT step every `rollout_steps_per_sft` RL iterations.")
    path: str | None = Field(None, description="SFT file (messages or prompt/response); None uses the built-in task.")
    num_examples: int = Field(2000, ge=1, description="Demonstrations generated when the built-in task is used.")
    rollout_steps_per_sft: int = Field(1, ge=1, description="RL iterations between two SFT steps.")
    global_batch_size: int = Field(16, ge=1, description="SFT sequences per step, over all ranks.")
    max_length: int = Field(128, ge=1, description="Longest SFT sequence (prompt + response) in tokens.")
    loss_weight: float = Field(1.0, gt=0, description="Multiplier on the SFT cross-entropy.")


class VLLMConfig(_Strict):
    """The vLLM server rlpipe starts for `rollout.engine=vllm` when no `rollout.server_url` is given."""

    python: str | None = Field(
        None, description="Python of the vLLM venv; None: $RLPIPE_VLLM_PYTHON, else .venv-vllm/bin/python."
    )
    host: str = Field("127.0.0.1", description="Interface the server listens on.")
    port: int = Field(0, ge=0, le=65535, description="Port of the server (0 = a free port).")
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="Longest prompt + response the server accepts; None: what the run needs "
        "(data.max_prompt_length + rollout.max_new_tokens).",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of a CPU server in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Share of GPU memory a GPU server may take.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health before failing.")
    max_restarts: int = Field(2, ge=0, description="Restarts of a crashed server (from the last synced weights).")
    extra_args: list[str] = Field(default_factory=list, description="Extra command-line arguments of the server.")
    replicas: int = Field(
        1,
        ge=1,
        description="Managed servers serving one run (rlpipe.rollout.replicas). 1 with no `resources`: one server "
        "beside the driver. Otherwise each runs in a Ray actor that Ray places by `resources` and that keeps its "
        "weights on its own node (they travel through the object store).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description='Ray resources each replica actor needs besides `num_cpus`, e.g. {"GPU": 1} or the custom '
        'resource of an engine worker group ({"rollout_engine": 1}, k8s/overlays/gpu).',
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica actor.")


class WeightSyncConfig(_Strict):
    """How a server engine (vllm, sglang) is kept serving the current policy, and how that is verified."""

    method: Literal["disk", "nccl"] = Field(
        "disk",
        description="disk: safetensors in `dir` (managed replicas: through Ray's object store), reloaded in place; "
        "nccl: vLLM's NCCL transfer (GPU), each tensor broadcast once to every replica in one group.",
    )
    dir: str | None = Field(
        None, description="Where published weights go; the server must see it. None: <output_dir>/serving."
    )
    probe_sequences: int = Field(4, ge=1, description="Prompt + response sequences scored after every sync.")
    probe_tolerance: float | None = Field(
        None, gt=0, description="Max |logprob difference| engine vs trainer on the probe; None: 1e-3 fp32, 0.1 bf16."
    )
    bucket_mb: int = Field(256, ge=1, description="NCCL transfer: tensors gathered and sent per bucket (MiB).")


class RolloutConfig(_Strict):
    """Sampling: how many prompts per iteration, how many responses per prompt, how they are scored."""

    engine: Literal["hf", "vllm", "sglang", "openai"] = Field(
        "hf",
        description="hf: generate in the workers (each rank holds a full unsharded copy of the policy for it, even "
        "with train.fsdp: docs/ARCHITECTURE.md); vllm: a vLLM server rlpipe starts (or `server_url`) and keeps in "
        "sync; sglang: an SGLang server at `server_url`, kept in sync; openai: any OpenAI-compatible server that is "
        "NOT synced (off-policy after the first update: needs algo.rollout_is.enabled).",
    )
    server_url: str | None = Field(
        None, description="Base URL of the server (openai, sglang; vllm: connect instead of starting one)."
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="Several servers of one engine (vllm, sglang) to spread prompts over, each synced and verified; "
        "instead of `server_url`. They must all see `weight_sync.dir`.",
    )
    server_model: str | None = Field(None, description="Model name sent to the server (default: 'policy').")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="The managed vLLM server (engine=vllm).")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Weight sync of server engines (vllm, sglang)."
    )
    prompts_per_step: int = Field(64, ge=1, description="Prompts sampled per RL iteration (global).")
    n: int = Field(8, ge=1, description="Responses per prompt: the group size of group-relative advantages.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    max_new_tokens: int = Field(6, ge=1, description="Longest response in tokens.")
    batch_size: int = Field(256, ge=1, description="Sequences per generate call (memory bound).")
    judge: str = Field("auto", description="Reward function name (see rlpipe.rollout.judges.JUDGES).")
    filter_uniform_groups: bool = Field(False, description="Drop groups whose rewards are all equal (no signal).")
    eval_temperature: float = Field(0.0, ge=0, description="Temperature of `evaluate` (0 = greedy).")
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: rollout, then train, strictly in turn (synchronous). k >= 1: a producer thread samples batch "
        "i+1 from the server engine while the trainer trains batch i; batch i is sampled from the weights after "
        "iteration i-1-k (exactly k updates old; rlpipe.loop_async). Needs a synced server engine (vllm, sglang) "
        "and algo.rollout_is.enabled to correct the gap.",
    )


class RolloutISConfig(_Strict):
    """Rollout importance sampling: correct for the rollout engine's distribution differing from the trainer's."""

    enabled: bool = Field(False, description="Multiply the policy loss by old/rollout importance weights.")
    level: Literal["token", "sequence", "geometric"] = Field("token", description="Granularity of the weight.")
    mode: Literal["truncate", "mask", "both"] = Field("truncate", description="How weights outside bounds are handled.")
    upper: float = Field(2.0, gt=0, description="Upper threshold of the weight.")
    lower: float | None = Field(None, gt=0, description="Lower threshold (mask/both); default 1/upper.")
    veto_threshold: float | None = Field(
        None, gt=0, description="Zero a whole sequence if any token ratio is below this."
    )


class AlgoConfig(_Strict):
    """The RL objective."""

    advantage: str = Field("grpo", description="Advantage estimator (grpo, rloo, dr_grpo, opo, pass_at_k).")
    pass_at_k: int = Field(4, ge=1, description="k of the pass_at_k advantage.")
    policy_loss: str = Field("vanilla", description="Policy loss (vanilla/ppo_clip, gspo).")
    clip_low: float = Field(
        0.2,
        ge=0,
        description="Lower clip range of the ratio (1 - clip_low); of the sequence ratio under gspo (the GSPO paper "
        "uses 3e-4; the default is PPO's). The clip_frac metrics use the same range.",
    )
    clip_high: float = Field(
        0.28,
        ge=0,
        description="Upper clip range (1 + clip_high): clip-higher of DAPO; GSPO's paper uses 4e-4 for its sequence "
        "ratio.",
    )
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip constant for negative advantages.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become one number (token-mean uses the global token count)."
    )
    use_kl_loss: bool = Field(
        False,
        description="Add a KL-to-reference term to the loss (builds a reference model; with model.lora the "
        "reference is the base, i.e. the policy with its adapters off, and no second model is built).",
    )
    kl_coef: float = Field(0.001, ge=0, description="Weight of the KL term.")
    kl_kind: str = Field("low_var_kl", description="KL estimator (k1, abs, k2, k3/low_var_kl).")
    rollout_is: RolloutISConfig = Field(default_factory=RolloutISConfig, description="Rollout importance sampling.")
    chunk_size: int = Field(1024, ge=1, description="Tokens per chunk of the chunked logprob (memory vs speed).")


class TrainConfig(_Strict):
    """Optimisation and parallelism of the training workers."""

    world_size: int = Field(
        2, ge=1, description="Training workers (Ray actors), one rank each: dp x sp_size (dp = world_size / sp_size)."
    )
    sp_size: int = Field(
        1,
        ge=1,
        description="Sequence parallelism: split every pack's tokens over this many ranks (an sp group; Ulysses "
        "attention, rlpipe.models.sequence_parallel). The sp ranks of a group train the same packs, each holding "
        "1/sp_size of their activations; data is sharded over the dp = world_size / sp_size groups. Same logprobs, "
        "losses and gradients as 1. Must divide world_size and be at most the model's attention heads (split as "
        "evenly as possible; kv heads split or repeated to match); needs model.attn_implementation=sdpa with "
        "train.packed_attention.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda with nccl if available, else cpu/gloo."
    )
    threads_per_worker: int = Field(1, ge=1, description="torch intra-op threads per CPU worker.")
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="Ray placement of the trainer ranks (one placement-group bundle each). pack: as few nodes as "
        "possible (Ray PACK, best effort: ranks may still land on several nodes when one has no room). spread: every "
        "rank on its own node (Ray STRICT_SPREAD: it needs world_size nodes with room; fewer is the placement error "
        "after train.placement_timeout_s, never a silent fallback to packing).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each trainer bundle asks for besides its CPU (and GPU), e.g. {trainer: 1}: "
        "with nodes started with that resource (KubeRay rayStartParams `resources`) the ranks land only there, not "
        "on rollout-engine nodes. CPU, GPU and memory are rlpipe's own and cannot be named here.",
    )
    placement_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long to wait for the cluster to place the trainer bundles (an autoscaler may be adding "
        "nodes) before failing with an error naming train.placement and the resources; Ray itself waits forever.",
    )
    lr: float = Field(
        5e-4,
        gt=0,
        description="Peak learning rate of AdamW. 5e-4 is the default task's: its run learns as far in 400 "
        "iterations as at 1e-3 (reward 0.30 -> 0.88), and rollout.max_staleness=1 learns as well as 0 at 5e-4 but "
        "collapses at 1e-3, where one update moves the tiny policy too far for rollout IS (bench/async_rollout.py).",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1) (torch's rule).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warm-up.")
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear warm-up optimizer steps. A fresh AdamW's first steps move every weight by ~lr (sign-like); "
        "without warm-up the default run's first update (at lr 1e-3) dropped reward from 0.28 to 0.05.",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of the peak (linear/cosine).")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm; a non-finite norm skips the step.")
    optimizer_steps: int = Field(1, ge=1, description="Optimizer steps per RL iteration (mini-batches).")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto",
        description="auto: with one optimizer step per iteration and rollout IS off the old policy is the current "
        "one, so old logprobs are the training forward's own (detached; ratio exactly 1) and one forward pass is "
        "saved; recompute: always a separate no-grad forward first (the seed's order).",
    )
    packed_attention: bool = Field(
        True,
        description="With model.attn_implementation='sdpa', score packs with rlpipe's per-sequence sdpa "
        "(rlpipe.models.packed_attention) instead of a dense L x L block mask; generation always uses sdpa.",
    )
    share_prompts: bool = Field(
        True,
        description="Compute a prompt once for all its samples in a pack (rlpipe.data.packing: shared-prompt units; "
        "same logprobs and gradients). Needs the packed attention (packed_attention with sdpa); otherwise off.",
    )
    pack_max_length: int = Field(
        2048, ge=8, description="Token budget of one packed micro-batch (2048: fastest measured for the tiny default)."
    )
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="Seed of model init, sampling and shuffles.")
    deterministic: bool = Field(True, description="torch deterministic algorithms (identical reruns on CPU).")
    ref_load_from: str | None = Field(None, description="Reference model dir for KL; None uses the base policy.")
    ref_offload: bool = Field(
        True,
        description="Keep the KL reference's weights in CPU memory between uses (GPU runs; no effect on CPU). The "
        "reference follows the policy's layout (train.fsdp). Replicated: the full copy moves to the device for the "
        "reference-logprob pass and back (as the seed). FSDP2-sharded: each rank keeps its 1/dp shards in CPU memory "
        "(FSDP2 CPUOffloadPolicy) and copies a unit to the device only while it is gathered for the forward; false "
        "keeps the shards on the device (no host-to-device copies, 1/dp of the reference in device memory).",
    )
    fsdp: bool | Literal["auto"] = Field(
        "auto",
        description="Shard the policy with FSDP2 (fully_shard) over the dp ranks. false: every rank holds the whole "
        "policy and optimizer state and gradients are summed over ranks in flat ~25 MB buckets (as DDP): fewer, "
        "larger collectives. auto: shard when the policy's parameters take 1 GiB or more, replicate below (the tiny "
        "default's RL step on 2 CPU workers is faster replicated: bench/layouts.py).",
    )
    fsdp_reshard_after_forward: bool | Literal["auto"] = Field(
        "auto",
        description="FSDP2 reshard_after_forward of the decoder layers. true: free gathered weights after each forward "
        "and gather again in backward (ZeRO-3 memory); false: keep them to the backward (one all-gather per layer and "
        "micro-batch less). auto: false when the whole policy is under 1 GiB (a few MB of extra memory; the tiny "
        "default's fit step 65 -> 50 ms on gloo), true above.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of keeping them (non-reentrant "
        "torch checkpoint per layer, applied before FSDP2 sharding; same gradients). Saves activation memory for "
        "about one extra forward of compute (bench/memory_features.py).",
    )
    mixed_precision: Literal["off", "bf16"] = Field(
        "off",
        description="bf16: compute in bfloat16, keep fp32 master weights, gradients and AdamW states (model.dtype "
        "must stay float32). Sharded policies use FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); "
        "replicated ones torch.autocast(bf16). Logprobs, their LM-head matmul and the loss stay fp32.",
    )
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto",
        description="AdamW kernel: fused (one kernel over all parameters), foreach (multi-tensor ops), for_loop "
        "(one parameter at a time). auto: fused where torch has it (CUDA, CPU), else foreach. Same update up to "
        "float rounding.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer's forward (inductor; on CPU it needs a C++ compiler). The "
        "first steps pay the compile time; meant for GPUs.",
    )

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"train.resources.{name}: rlpipe sets CPU/GPU per rank itself; name custom resources")
            if not amount > 0:
                raise ValueError(f"train.resources.{name}={amount} must be > 0")
        return value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(value):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"train.betas[{i}]={beta} must be in [0, 1) (AdamW refuses it otherwise)")
        return value


class CheckpointConfig(_Strict):
    """Where checkpoints go and what they contain."""

    root: str = Field("runs/checkpoints", description="Checkpoint root; one sub-directory per experiment.")
    every: int = Field(0, ge=0, description="Also checkpoint every N iterations inside a segment (0 = segment end).")
    save_optimizer: bool = Field(True, description="Store optimizer state (needed for exact resume).")
    save_hf: bool = Field(False, description="Also export safetensors in HF format (for vLLM/SGLang serving).")
    init_from: str | None = Field(
        None,
        description="Start a new stage from this checkpoint's weights only (a local checkpoint dir of the same model "
        "shape, any world size): fresh AdamW, LR schedule, counters, samplers and RNG; the stage's first checkpoint "
        "records it as parent with parent_weights_only=true. Used only when the run starts without a checkpoint of its "
        "own (a resume of this experiment wins); give the stage its own `experiment`. The KL reference stays "
        "train.ref_load_from or the base model. See docs/ARCHITECTURE.md, Checkpoints and resume.",
    )


class PipelineConfig(_Strict):
    """Everything one RL run needs."""

    experiment: str = Field(
        "grpo-sum",
        description="Experiment name: checkpoint sub-directory, metrics sub-directory and lineage key. One path "
        f"component: `{NAME_PATTERN}`, no '..' (rlpipe.io.check_name).",
    )
    output_dir: str = Field("runs", description="Base model, metrics.jsonl and generated data go here.")
    iterations: int = Field(400, ge=1, description="RL iterations in total.")
    segment_size: int = Field(100, ge=1, description="Iterations per Ray job in the segment workflow.")
    eval_every: int = Field(0, ge=0, description="Evaluate on held-out prompts every N iterations (0 = never).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Periodic SFT.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling and rewards.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="Objective.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation and parallelism.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")

    @model_validator(mode="after")
    def _consistent(self) -> PipelineConfig:
        check_consistency(self)
        return self

    @field_validator("experiment")
    @classmethod
    def _experiment_is_a_name(cls, value: str) -> str:
        return check_name(value, "experiment")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (groups of `train.sp_size` workers that train the same packs)."""
        return self.train.world_size // self.train.sp_size

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.root) / self.experiment


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> PipelineConfig:
    """Read a YAML config (None = defaults), apply dotted `overrides`, validate; errors name the file and field."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path} is not UTF-8 text: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded or {}
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return validate_config(raw, source=str(path) if path else "<defaults>")


def validate_config(raw: dict, source: str = "<config>") -> PipelineConfig:
    """Validate a plain dict into a PipelineConfig, turning pydantic's report into one ConfigError."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config {source}: {problems}") from exc


def parse_override(text: str) -> tuple[str, object]:
    """`a.b=3` -> ("a.b", 3); the value is parsed as YAML so numbers, bools and lists work."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, value = text.split("=", 1)
    parsed = yaml.safe_load(value)
    if isinstance(parsed, str):  # YAML 1.1 reads "1e-4" as a string; numbers typed on a command line are numbers
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return key.strip(), parsed


def set_dotted(tree: dict, dotted: str, value: object) -> None:
    """Set `tree["a"]["b"]["c"] = value` for `dotted` "a.b.c" (an override), creating sections on the way."""
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value
