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


OPTIMIZER_IMPLS = ("fused", "foreach", "for_loop")


def resolve_optimizer_impl(impl: str, device_type: str) -> str:
    """The AdamW kernel for `train.optimizer_impl` on `device_type`.

    auto -> fused wherever torch has the kernel (CUDA and CPU; one pass over all parameters, no full-size
    temporaries; a smoke run of bench/memory_features.py on CPU: fused 0.49x, foreach 2.7x the for_loop step
    time), foreach elsewhere. An explicit choice is checked against what
    torch has a kernel for, so a bad setting fails at build time, naming the field.
    """
    if impl == "auto":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return "fused" if device_type in _get_fused_kernels_supported_devices() else "foreach"
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"train.optimizer_impl={impl!r}: expected auto, {', '.join(OPTIMIZER_IMPLS)}")
    if impl == "fused":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if device_type not in _get_fused_kernels_supported_devices():
            raise ValueError(f"train.optimizer_impl=fused: torch has no fused AdamW for device {device_type!r}")
    return impl


def set_optimizer_impl(optimizer: torch.optim.Optimizer, impl: str) -> None:
    """Point every param group at `impl` (one of OPTIMIZER_IMPLS).

    Also called after loading a checkpoint: `load_state_dict` restores the saved groups' `fused`/`foreach` flags,
    so without this a resumed run would keep the kernel of the run that wrote the checkpoint. Fused AdamW keeps its
    step counters on the parameter's device, the other two on the CPU; existing counters are moved to match.
    """
    fused = impl == "fused"
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, impl == "foreach"
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and torch.is_tensor(state.get("step")):
                device = param.device if fused or group.get("capturable") else torch.device("cpu")
                state["step"] = state["step"].to(device=device, dtype=torch.float32)


def build_optimizer(params, cfg: TrainConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW over `params` with the kernel `train.optimizer_impl` resolves to on `device_type`."""
    impl = resolve_optimizer_impl(cfg.optimizer_impl, device_type)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8,
                             foreach=impl == "foreach", fused=impl == "fused")  # fmt: skip


def set_lr(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Set every param group's LR for optimizer step `step`; returns the LR (stateless: resume needs only `step`)."""
    lr = cfg.lr * lr_multiplier(step, cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
