"""AdamW and the learning-rate schedule (the seed worker has none: constant, linear or cosine after a warm-up)."""

from __future__ import annotations

import math

import torch

from rlpipe.config import TrainConfig


def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based).

    Warm-up: (step+1)/warmup_steps for step < warmup_steps. Then, with progress p in [0, 1] over the remaining steps:
    constant -> 1; linear -> 1 - (1-min)·p; cosine -> min + (1-min)·½(1 + cos(πp)).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r} (constant, linear, cosine)")


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `params`; foreach=False keeps CPU and DTensor (FSDP2) parameters on the same, simple path."""
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8, foreach=False
    )


def set_lr(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Set every param group's LR for optimizer step `step`; returns the LR (stateless: resume needs only `step`)."""
    lr = cfg.lr * lr_multiplier(step, cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
