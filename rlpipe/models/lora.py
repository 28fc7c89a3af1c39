"""LoRA adapters on the policy (`model.lora`), built with peft: injection, deterministic init, the base-model view
(adapters switched off: the KL reference), and the names peft and vLLM expect on disk.

The adapters are injected into the HF model in place (`peft.inject_adapter_in_model`), not wrapped in a
`PeftModel`: the module tree keeps its HF root, so `get_decoder()`, the decoder layers FSDP2 shards and activation
checkpointing wraps, and the packed forward all stay the same. A targeted `q_proj` becomes a peft `Linear` whose
base weight is `q_proj.base_layer.weight` (frozen) with `q_proj.lora_A.default.weight` / `lora_B` beside it (the
only trainable parameters). peft is imported lazily: the config class below is read by `rlpipe.config`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

ADAPTER_NAME = "default"  # peft's name of the single adapter rlpipe trains
LLAMA_QWEN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # peft's saved adapter keys start with it (the PeftModel -> LoraModel path)


class LoRAConfig(BaseModel):
    """LoRA on the policy: only the adapters train; the base weights stay frozen and are the KL reference."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(False, description="Train LoRA adapters (peft) instead of the full policy.")
    rank: int = Field(16, ge=1, le=512, description="Adapter rank r (vLLM serves ranks up to 512).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter input in training forwards. 0 by default: with dropout the training "
        "forward is not the policy that sampled, so the PPO ratio is no longer exactly 1 on-policy.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_QWEN_TARGETS),
        min_length=1,
        description="Module names (suffixes) that get an adapter. The default covers every attention and MLP "
        "projection of Llama/Qwen/Mistral-style models (q,k,v,o,gate,up,down_proj); e.g. ['q_proj', 'v_proj'] for "
        "attention only, or c_attn/c_proj for GPT-2.",
    )


def peft_lora_config(cfg: LoRAConfig, base_model_dir: str | None = None):
    """The `peft.LoraConfig` of `cfg` (peft's default init: A kaiming-uniform, B zero, so the adapter starts as 0)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_dir)  # fmt: skip


def apply_lora(hf_model: nn.Module, cfg: LoRAConfig, low_cpu_mem_usage: bool = False) -> nn.Module:
    """Inject `cfg`'s adapters into `hf_model` in place and freeze everything else; returns the same model.

    `low_cpu_mem_usage`: adapters on the meta device (a meta-initialised model, filled after FSDP2 sharding).
    Raises ValueError naming `model.lora.target_modules` when no module matches.
    """
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_lora_config(cfg), hf_model, ADAPTER_NAME, low_cpu_mem_usage=low_cpu_mem_usage)
    except ValueError as e:
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {e}") from e
    for name, param in hf_model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    return hf_model


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter weight (`...lora_A.default.weight`, `...lora_B...`)."""
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def base_weight_name(name: str) -> str:
    """The name a frozen base weight has in the base model's files (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter_param(n) for n, _ in model.named_parameters())


def _adapter_seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2**63


@torch.no_grad()
def init_adapter_weights(model: nn.Module, seed: int) -> None:
    """Set every adapter to peft's initial values, the same on every rank and layout: lora_A kaiming-uniform
    (a=sqrt(5), bound 1/sqrt(fan_in)), drawn from a generator seeded by (`seed`, parameter name); lora_B zero.

    Why not peft's own init: it draws from the global RNG at injection time, so a meta-initialised FSDP2 policy
    (whose adapters are allocated later, per shard) and a replicated one would start from different adapters.
    A sharded parameter (DTensor) gets its own shard of the full tensor.
    """
    for name, param in model.named_parameters():
        if not is_adapter_param(name):
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            gen = torch.Generator().manual_seed(_adapter_seed(name, seed))
            bound = 1.0 / math.sqrt(param.shape[1])
            full.uniform_(-bound, bound, generator=gen)
        _copy_full_into(param, full)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, which may be an FSDP2 DTensor shard."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer computes only its base layer inside the block (the KL reference).

    Sets peft's per-layer `_disable_adapters` flag directly rather than calling `enable_adapters(False)`, which
    also flips the adapters' `requires_grad`: FSDP2 and the optimizer must never see that change mid-run.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, saved, strict=True):
            m._disable_adapters = flag


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full HF-named state dict, under the names peft saves (and vLLM loads):
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` -> `base_model.model.model.layers.0...lora_A.weight`."""
    out = {}
    for name, tensor in state.items():
        if is_adapter_param(name):
            key = PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.")
            out[key.replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")] = tensor.detach().to("cpu").contiguous()
    return out
