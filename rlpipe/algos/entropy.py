"""The seed's "entropy" metric: the mean negative logprob of the *sampled* tokens.

This is a one-sample estimate of the policy entropy (``E[-log pi(y)]`` under ``y ~ pi``), cheap because it reuses
the logprobs already computed; it is what the seed logs as ``train_entropy`` (old logprobs) and
``rollout_entropy`` (rollout logprobs). No ``torch.distributed`` here: the caller all-reduces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100


def sampled_token_entropy_sum(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``-sum(mask * logprob)``; divide the all-reduced sum by the all-reduced number of masked tokens."""
    return -torch.where(mask.bool(), logprobs.detach(), torch.zeros_like(logprobs)).sum()


def entropy_metric(
    logprobs_list: Sequence[torch.Tensor | None],
    labels_list: Sequence[torch.Tensor],
    global_tokens: torch.Tensor | float,
) -> torch.Tensor | None:
    """The seed's ``calculate_entropy`` minus its all-reduce: ``sum_i -sum(logp_i * (labels_i != -100)) / global``.

    Returns None when there are no logprobs (e.g. no rollout logprobs), 0 when ``global_tokens`` is 0. Because the
    denominator is already global, all-reducing (SUM) the returned value over ranks gives the seed's value.
    """
    if len(logprobs_list) == 0 or logprobs_list[0] is None:
        return None
    total = None
    for lp, labels in zip(logprobs_list, labels_list, strict=True):
        if lp is None:
            raise ValueError("entropy_metric got None logprobs after a non-None entry")
        s = sampled_token_entropy_sum(lp, labels != IGNORE_INDEX)
        total = s if total is None else total + s
    denom = torch.as_tensor(global_tokens, dtype=total.dtype, device=total.device)
    return total / denom if float(denom) > 0 else torch.zeros((), dtype=total.dtype, device=total.device)
