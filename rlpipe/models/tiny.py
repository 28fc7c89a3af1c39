"""The tiny default model: a randomly initialised Qwen2/Llama-architecture causal LM for the built-in tasks.

It is a real HF architecture (not a toy module) so that the pipeline exercises exactly the code path a
pretrained model takes: saved as safetensors + tokenizer + generation_config, loaded with ``load_model``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedModel, Qwen2Config

from rlpipe.errors import ConfigError
from rlpipe.models.tokenizer import build_tiny_tokenizer


class TinyModelConfig(BaseModel):
    """Shape of the tiny default model (defaults: ~0.1M non-embedding params, trains in seconds on CPU)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    arch: Literal["qwen2", "llama"] = Field("qwen2", description="HF architecture family of the config.")
    hidden_size: int = Field(64, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(2, gt=0, description="Number of decoder layers.")
    num_heads: int = Field(
        2,
        gt=0,
        description="Attention (query) heads; must divide hidden_size. 2 gives head_dim 32, the smallest "
        "vLLM's CPU attention supports (rollout.engine=vllm).",
    )
    num_kv_heads: int = Field(1, gt=0, description="Key/value heads (GQA); must divide num_heads.")
    intermediate_size: int = Field(256, gt=0, description="Hidden width of the SwiGLU MLP.")
    max_position_embeddings: int = Field(256, gt=0, description="Longest sequence (prompt + response) supported.")
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head weights.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    initializer_range: float = Field(0.02, gt=0, description="Std of the normal weight init.")


def _check_shape(cfg: TinyModelConfig) -> None:
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"tiny model: hidden_size {cfg.hidden_size} is not divisible by num_heads {cfg.num_heads}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"tiny model: num_heads {cfg.num_heads} is not divisible by num_kv_heads {cfg.num_kv_heads}")
    if (cfg.hidden_size // cfg.num_heads) % 2:
        raise ConfigError("tiny model: head dim (hidden_size / num_heads) must be even for RoPE")


def tiny_hf_config(
    cfg: TinyModelConfig,
    vocab_size: int,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = 2,
) -> Qwen2Config | LlamaConfig:
    """The HF config object for ``cfg`` (Qwen2Config or LlamaConfig)."""
    _check_shape(cfg)
    if vocab_size <= 0:
        raise ConfigError(f"tiny model: vocab_size must be positive, got {vocab_size}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def build_tiny_model(
    cfg: TinyModelConfig,
    vocab_size: int,
    seed: int = 0,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = 2,
) -> PreTrainedModel:
    """Randomly initialised causal LM, deterministic in ``seed`` (fp32, CPU, eval mode)."""
    hf_cfg = tiny_hf_config(cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.eval()
    return model


def create_tiny_model_dir(out_dir: str | Path, cfg: TinyModelConfig | None = None, seed: int = 0) -> str:
    """Write a loadable HF model dir (safetensors + char tokenizer + generation_config) and return its path.

    The caller owns atomicity (write to a temp dir and rename) if several processes may race on ``out_dir``.
    """
    cfg = cfg or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(cfg, len(tok), seed, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)
