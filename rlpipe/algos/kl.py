"""Per-token estimators of KL(policy || reference) from the logprobs of sampled tokens.

``d = logp - ref`` for tokens sampled from the policy (Schulman, "Approximating KL Divergence", 2020; names as in
verl / the seed worker):

- ``k1`` / ``kl``: ``d`` (unbiased, high variance, can be negative),
- ``abs``: ``|d|``,
- ``k2`` / ``mse``: ``d^2 / 2`` (biased, low variance),
- ``k3`` / ``low_var_kl``: with ``k = clamp(ref - logp, -20, 20)``, ``clamp(exp(k) - k - 1, -10, 10)``
  (unbiased and always >= 0; the clamps keep outliers from dominating, as in the seed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlpipe.algos.registry import lookup


def _k1(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return logp - ref


def _abs(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (logp - ref).abs()


def _k2(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref).square()


def _k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    k = torch.clamp(ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(k) - k - 1.0, -10.0, 10.0)


KL_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (see module doc); same shape as the inputs. Unknown kind: ValueError."""
    return lookup(KL_KINDS, kind, "KL kind")(logprobs, ref_logprobs)


def masked_kl_sum(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """``sum(kl * mask)`` as the seed computes it; the caller divides by the all-reduced global token count."""
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    return torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum()
