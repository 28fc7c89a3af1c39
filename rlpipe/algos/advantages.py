"""Group-relative advantage estimators: one scalar per response, from the rewards of its group.

``rewards`` is ``[num_groups, group_size]`` (the ``n`` responses sampled for one prompt form a group); every
estimator returns a tensor of the same shape and dtype (integer rewards are promoted to float32). A group of one has
no baseline: its advantage is 0, never NaN.

Uniform groups are exact: every estimator computes in float64 and sets ``A = 0`` exactly where all rewards of a
group are equal. A group with no signal must not update the policy; in float32 a group of eight 0.7 rewards has a
mean that differs from 0.7 and a std of ~6e-8, which ``eps = 1e-8`` does not dominate, so GRPO gave it advantages
of order 1 and random sign (issue 17).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from rlpipe.algos.registry import lookup


def _check(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """``(rewards as float64, dtype of the result)``: the math runs in float64 whatever the input precision."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return rewards.to(torch.float64), dtype


def _finish(advantages: torch.Tensor, rewards: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact 0 for groups whose rewards are all equal (no signal, whatever the rounding), cast to ``dtype``."""
    uniform = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(advantages), advantages).to(dtype)


def grpo(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean(r)) / (std(r) + eps)``, unbiased std of the group.

    All-equal rewards give exactly 0 (see the module doc); a group of one gives 0.
    """
    r, dtype = _check(rewards)
    if r.shape[1] < 2:
        return torch.zeros_like(r, dtype=dtype)
    return _finish((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, correction=1) + eps), r, dtype)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, ``A_i = r_i - mean_{j != i} r_j``; a group of one gives 0.

    Equivalently ``G/(G-1) * (r_i - mean(r))``.
    """
    r, dtype = _check(rewards)
    g = r.shape[1]
    if g < 2:
        return torch.zeros_like(r, dtype=dtype)
    return _finish(r - (r.sum(dim=1, keepdim=True) - r) / (g - 1), r, dtype)


def dr_grpo(rewards: torch.Tensor, lengths: torch.Tensor | None = None, max_length: int | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean(r)``, no std division.

    The paper's other change, replacing the per-response ``1/|o_i|`` by a constant, is a property of the loss, not of
    the advantage: train with ``loss_agg: seq-mean-token-sum-norm``, which divides every sequence's token sum by
    ``max_length``. ``lengths`` and ``max_length`` are accepted for a uniform call signature and are *not* used here
    (scaling the advantage by ``lengths / max_length`` would re-introduce the length bias the paper removes).
    """
    r, dtype = _check(rewards)
    return _finish(r - r.mean(dim=1, keepdim=True), r, dtype)


def opo(rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal reward baseline"): length-weighted baseline.

    ``b = sum_i l_i r_i / sum_i l_i`` per group, ``A_i = r_i - b``: the variance-minimising baseline when the
    gradient norm of a response grows with its length. A group whose lengths sum to 0 falls back to the plain mean.
    """
    r, dtype = _check(rewards)
    if lengths is None or tuple(lengths.shape) != tuple(r.shape):
        got = None if lengths is None else tuple(lengths.shape)
        raise ValueError(f"opo needs lengths of shape {tuple(r.shape)} (response lengths), got {got}")
    length = lengths.to(r.dtype)
    total = length.sum(dim=1, keepdim=True)
    weighted = (length * r).sum(dim=1, keepdim=True) / total.clamp(min=torch.finfo(r.dtype).tiny)
    baseline = torch.where(total > 0, weighted, r.mean(dim=1, keepdim=True))
    return _finish(r - baseline, r, dtype)


def pass_at_k(rewards: torch.Tensor, k: int = 4) -> torch.Tensor:
    """Pass@k advantage, analytic form of "Pass@k Training for Adaptively Balancing Exploration and Exploitation of
    Large Reasoning Models" (Chen et al. 2025), for binary rewards (every reward must be 0 or 1).

    The group of ``N`` responses is seen as all ``C(N, k)`` subsets of size ``k``; a subset's reward is the max of its
    members (pass@k), normalised over subsets by mean ``R = 1 - C(N_neg, k)/C(N, k)`` and std ``s = sqrt(R(1-R))``.
    A response's advantage is the mean normalised reward of the subsets that contain it:

    - correct response: ``(1 - R) / (s + eps)``,
    - wrong response: ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / (s + eps)``,

    with ``eps = 1e-8``. All-correct or all-wrong groups get 0. ``k = 1`` reduces to GRPO with the population std.
    """
    r, dtype = _check(rewards)
    n = r.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= group_size ({n}), got k={k}")
    if not bool(((r == 0) | (r == 1)).all()):
        raise ValueError("pass_at_k needs binary rewards (0 or 1); use a 0/1 judge or another advantage")
    n_neg = (r == 0).sum(dim=1)  # [num_groups]
    # Tables over every possible number of wrong answers 0..n, exact in python ints.
    none_pass = [math.comb(m, k) / math.comb(n, k) for m in range(n + 1)]
    wrong_in_all_fail = [math.comb(m - 1, k - 1) / math.comb(n - 1, k - 1) if m > 0 else 0.0 for m in range(n + 1)]
    dev = r.device
    mean = 1.0 - torch.tensor(none_pass, dtype=torch.float64, device=dev)[n_neg]
    std = torch.sqrt((mean * (1.0 - mean)).clamp(min=0.0))
    pos = (1.0 - mean) / (std + 1e-8)
    neg = (1.0 - mean - torch.tensor(wrong_in_all_fail, dtype=torch.float64, device=dev)[n_neg]) / (std + 1e-8)
    out = torch.where(r == 1, pos[:, None], neg[:, None])
    return _finish(out, r, dtype)


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo,
    "rloo": rloo,
    "dr_grpo": dr_grpo,
    "opo": opo,
    "pass_at_k": pass_at_k,
}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    lengths: torch.Tensor | None = None,
    max_length: int | None = None,
    **kw,
) -> torch.Tensor:
    """Run estimator ``name`` on ``rewards``; ``lengths``/``max_length`` are passed only to estimators that take them.

    Unknown names raise ``UnknownNameError`` (a ``ValueError``) listing the known ones.
    """
    fn = lookup(ADVANTAGES, name, "advantage estimator")
    params = inspect.signature(fn).parameters
    if "lengths" in params:
        kw["lengths"] = lengths
    if "max_length" in params:
        kw["max_length"] = max_length
    return fn(rewards, **kw)
