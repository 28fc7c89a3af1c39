"""Rollout importance sampling: correct for the gap between the rollout engine's and the trainer's distributions.

The rollout engine samples with its own numerics (other kernels, precision, a server); ``old_logprobs`` are the
trainer's recomputed logprobs of the same tokens. With ``lambda = old - rollout`` per token, the weight
``pi_old / pi_rollout`` re-weights the policy loss (as in verl's rollout IS / "Your efficient RL framework secretly
brings you off-policy RL training", Yao et al. 2025):

- level ``token``: ``w_t = exp(lambda_t)``; ``sequence``: ``w_i = exp(sum_{t in i} lambda_t)``; ``geometric``:
  ``w_i = exp(mean_{t in i} lambda_t)`` (sequence weights are broadcast to the sequence's tokens). The exponent is
  clamped to [-20, 20] so weights never overflow.
- mode ``truncate``: ``w = min(w, upper)`` (TIS); ``mask``: ``w * [lower <= w <= upper]`` (MIS); ``both``: mask
  outside [lower, upper], then truncate (with one pair of bounds the truncation is a no-op; kept for config parity).
  ``lower`` defaults to ``1 / upper``.
- veto: a sequence with any token whose ``exp(lambda_t) < veto_threshold`` gets weight 0 on all its tokens.

Weights are detached and 0 outside ``mask``. Metrics are ``MetricSums`` (reduce over ranks, then ``finalize``; also
usable as a dict of this call's values). ``rollout_is_mean/std/min/max`` and the ``ratio_fraction_*`` describe the
raw weights (after the log-space clamp, before truncate/mask/veto) so they show the real mismatch;
``rollout_is_eff_sample_size`` is ``(sum w)^2 / (N sum w^2)`` of the weights actually applied, and 0 when every
applied weight is 0 (every sequence vetoed or masked, or no tokens at all): no data, not a perfect 1.
``rollout_is_veto_fraction`` / ``rollout_is_veto_count`` are the fraction / number of vetoed sequences (global after
the cross-rank reduction). Token statistics are over masked tokens (sequence weights counted once per token),
``*_seq_*`` and veto fractions over sequences.
"""

from __future__ import annotations

import math

import torch

from rlpipe.algos.metrics import MetricSums
from rlpipe.algos.segments import segments

LOG_WEIGHT_CLAMP = 20.0
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "both")


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    upper: float = 2.0,
    lower: float | None = None,
    veto_threshold: float | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricSums]:
    """Detached IS weights (same shape as the inputs) and their metrics; see the module doc for the formulas."""
    if level not in LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; known: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"unknown rollout IS mode {mode!r}; known: {', '.join(MODES)}")
    if not upper > 0:
        raise ValueError(f"rollout IS upper must be > 0, got {upper}")
    lower = 1.0 / upper if lower is None else lower
    if not 0 <= lower <= upper:
        raise ValueError(f"rollout IS needs 0 <= lower <= upper, got lower={lower}, upper={upper}")
    if veto_threshold is not None and not veto_threshold > 0:
        raise ValueError(f"rollout IS veto_threshold must be > 0, got {veto_threshold}")

    mask = mask.bool()
    shape = old_logprobs.shape
    seg = segments(mask, seq_ids)
    lam = torch.where(mask, (old_logprobs - rollout_logprobs).detach().double(), 0.0)
    if level == "token":
        log_w = torch.clamp(lam, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    else:
        per_seq = seg.sum(lam) if level == "sequence" else seg.mean(lam)
        log_w = seg.broadcast(torch.clamp(per_seq, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP), shape)
    raw = torch.where(mask, torch.exp(log_w), 0.0)

    w = raw
    outside = mask & ((raw < lower) | (raw > upper))
    if mode in ("mask", "both"):
        w = torch.where(outside, 0.0, w)
    if mode in ("truncate", "both"):
        w = torch.clamp(w, max=upper)
    vetoed_seq = torch.zeros(seg.num_seqs, dtype=torch.bool, device=mask.device)
    if veto_threshold is not None:
        vetoed_seq = seg.any(lam < math.log(veto_threshold))
        w = torch.where(seg.broadcast(vetoed_seq.double(), shape) > 0, 0.0, w)
    w = torch.where(mask, w, 0.0)

    n = mask.sum()
    r = raw[mask]
    final = w[mask]
    masked_tok = outside if mode in ("mask", "both") else torch.zeros_like(outside)
    m = MetricSums(
        derived={
            "rollout_is_std": ("std", "rollout_is_mean", "_rollout_is_sq"),
            "rollout_is_eff_sample_size": ("ess", "_rollout_is_w", "_rollout_is_w_sq"),
            "rollout_is_veto_count": ("total", "rollout_is_veto_fraction", "rollout_is_veto_fraction"),
        },
        defaults={"rollout_is_mean": 1.0, "rollout_is_min": 1.0, "rollout_is_max": 1.0,
                  "rollout_is_eff_sample_size": 0.0},
    )  # fmt: skip
    m.add_mean("rollout_is_mean", r.sum(), n)
    m.add_mean("_rollout_is_sq", r.square().sum(), n)
    m.add_min("rollout_is_min", r)
    m.add_max("rollout_is_max", r)
    m.add_mean("_rollout_is_w", final.sum(), n)
    m.add_mean("_rollout_is_w_sq", final.square().sum(), n)
    m.add_mean("rollout_is_ratio_fraction_high", (r > upper).sum(), n)
    m.add_mean("rollout_is_ratio_fraction_low", (r < lower).sum(), n)
    m.add_mean("rollout_is_masked_fraction", masked_tok[mask].sum(), n)
    m.add_mean("rollout_is_seq_masked_fraction", seg.any(masked_tok).sum(), seg.num_seqs)
    m.add_mean("rollout_is_veto_fraction", vetoed_seq.sum(), seg.num_seqs)
    return w.to(old_logprobs.dtype), m


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
) -> MetricSums:
    """Training-vs-rollout mismatch diagnostics (logged even when IS is off), as ``MetricSums``.

    Token means over masked tokens: ``mismatch_kl`` = mean(rollout - old) (k1 estimate of KL(rollout || old), tokens
    sampled from the rollout policy) and ``mismatch_k3_kl`` = mean(exp(x) - 1 - x), x = clamp(old - rollout, +-20).
    Sequence means (per sequence, ``lp_i`` = mean logprob of its masked tokens): ``mismatch_training_ppl`` =
    mean exp(-lp_old_i), ``mismatch_rollout_ppl`` = mean exp(-lp_roll_i), ``mismatch_log_ppl_diff`` =
    mean(lp_roll_i - lp_old_i) (= log ppl_train - log ppl_rollout), ``mismatch_log_ppl_abs_diff`` (mean of |.|),
    ``mismatch_log_ppl_diff_max`` / ``_min`` over sequences, ``mismatch_ppl_ratio`` = mean ppl_train_i / ppl_roll_i.
    Computed in float64.
    """
    mask = mask.bool()
    seg = segments(mask, seq_ids)
    old = torch.where(mask, old_logprobs.detach().double(), 0.0)
    roll = torch.where(mask, rollout_logprobs.detach().double(), 0.0)
    n = mask.sum()
    d = (roll - old)[mask]
    x = torch.clamp(old - roll, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)[mask]
    lp_old, lp_roll = seg.mean(old), seg.mean(roll)
    diff = lp_roll - lp_old
    s = seg.num_seqs
    m = MetricSums(defaults={"mismatch_training_ppl": 1.0, "mismatch_rollout_ppl": 1.0, "mismatch_ppl_ratio": 1.0})
    m.add_mean("mismatch_kl", d.sum(), n)
    m.add_mean("mismatch_k3_kl", (torch.exp(x) - 1.0 - x).sum(), n)
    m.add_mean("mismatch_training_ppl", torch.exp(-lp_old).sum(), s)
    m.add_mean("mismatch_rollout_ppl", torch.exp(-lp_roll).sum(), s)
    m.add_mean("mismatch_log_ppl_diff", diff.sum(), s)
    m.add_mean("mismatch_log_ppl_abs_diff", diff.abs().sum(), s)
    m.add_max("mismatch_log_ppl_diff_max", diff)
    m.add_min("mismatch_log_ppl_diff_min", diff)
    m.add_mean("mismatch_ppl_ratio", torch.exp(diff).sum(), s)
    return m
