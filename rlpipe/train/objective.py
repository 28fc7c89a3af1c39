"""The RL and SFT objectives of one micro-batch, and the batch-level statistics the seed logs before training.

Everything here is a function of tensors; the only distributed calls are the all-reduces that turn this rank's
sums into global values (no-ops in a single process), so the same code serves world size 1 and N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.algos.entropy import sampled_token_entropy_sum
from rlpipe.algos.kl import kl_penalty
from rlpipe.algos.metrics import MetricSums
from rlpipe.algos.policy_loss import LOG_RATIO_CLAMP, POLICY_LOSSES, aggregate, gspo_sequence_stats
from rlpipe.algos.rollout_is import mismatch_metrics, rollout_is_weights
from rlpipe.config import AlgoConfig
from rlpipe.data.packing import IGNORE_INDEX, Pack
from rlpipe.train.distributed import all_reduce_min_max, all_reduce_sum


@dataclass
class BatchStats:
    """Global (all-rank) statistics of one RL batch, computed before the optimizer steps."""

    train_entropy: float
    rollout_entropy: float | None
    kl: float | None
    label_tokens: int
    real_tokens: int
    efficient_attn_ratio: float
    mismatch: dict[str, float]
    rollout_is: dict[str, float]
    is_weights: list[torch.Tensor] | None  # per pack, label-aligned, detached


def batch_statistics(
    packs: list[Pack], old: list[torch.Tensor], ref: list[torch.Tensor] | None, algo: AlgoConfig
) -> BatchStats:
    """Entropy (train, rollout), KL(old, ref), mismatch and rollout-IS metrics: the seed's pre-training block."""
    device = old[0].device if old else torch.device("cpu")
    masks = [p.shifted_labels != IGNORE_INDEX for p in packs]
    has_rollout = bool(packs) and packs[0].rollout_logprobs is not None
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    for p, lp, m in zip(packs, old, masks, strict=True):
        sums[0] += m.sum()
        sums[1] += p.num_sequence_tokens
        sums[2] += sampled_token_entropy_sum(lp, m).double()
        if has_rollout:
            sums[3] += sampled_token_entropy_sum(p.rollout_logprobs, m).double()
        sums[5] += p.attention_work
        sums[6] += p.length**2
    if ref is not None:
        for lp, rp, m in zip(old, ref, masks, strict=True):
            sums[4] += (kl_penalty(lp, rp, "low_var_kl") * m).sum().double()
    is_weights, local_metrics = None, {}
    if has_rollout and packs:
        old_cat, roll_cat = torch.cat(old), torch.cat([p.rollout_logprobs for p in packs])
        mask_cat, seq_cat = torch.cat(masks), torch.cat([p.seq_index for p in packs])
        local_metrics["mismatch"] = mismatch_metrics(old_cat, roll_cat, mask_cat, seq_cat)
        if algo.rollout_is.enabled:
            c = algo.rollout_is
            weights, local_metrics["is"] = rollout_is_weights(
                old_cat, roll_cat, mask_cat, level=c.level, mode=c.mode, upper=c.upper, lower=c.lower,
                veto_threshold=c.veto_threshold, seq_ids=seq_cat,
            )  # fmt: skip
            is_weights = list(torch.split(weights.detach(), [p.length for p in packs]))
    reduced = _reduce_with(sums, local_metrics)
    tokens = max(float(sums[0]), 1.0)
    return BatchStats(
        train_entropy=float(sums[2]) / tokens,
        rollout_entropy=float(sums[3]) / tokens if has_rollout else None,
        kl=float(sums[4]) / tokens if ref is not None else None,
        label_tokens=int(sums[0]),
        real_tokens=int(sums[1]),
        efficient_attn_ratio=float(sums[5] / sums[6]) if sums[6] > 0 else 0.0,
        mismatch=reduced.get("mismatch", {}),
        rollout_is=reduced.get("is", {}),
        is_weights=is_weights,
    )


def _reduce_with(sums: torch.Tensor, metrics: dict[str, MetricSums]) -> dict[str, dict[str, float]]:
    """Exact cross-rank merge of `sums` (in place) and the metric accumulators in two collectives (one SUM, one
    MAX), then means/std/ESS derived from the reduced sums."""
    parts = {name: m.to_tensors() for name, m in metrics.items()}
    sc = torch.cat([sums.reshape(-1).to(torch.float64)] + [p[0].to(torch.float64) for p in parts.values()])
    mn = torch.cat([p[1].to(torch.float64) for p in parts.values()]) if parts else sc.new_zeros(0)
    mx = torch.cat([p[2].to(torch.float64) for p in parts.values()]) if parts else sc.new_zeros(0)
    all_reduce_sum(sc)
    all_reduce_min_max(mn, mx)
    sums.copy_(sc[: sums.numel()].reshape(sums.shape))
    out, i, j, k = {}, sums.numel(), 0, 0
    for name, (s_, n_, x_) in parts.items():
        metrics[name].load_tensors(sc[i : i + s_.numel()], mn[j : j + n_.numel()], mx[k : k + x_.numel()])
        i, j, k = i + s_.numel(), j + n_.numel(), k + x_.numel()
        out[name] = metrics[name].finalize()
    return out


class StepSums:
    """Reducible sums of one optimizer step's micro-batches: losses, clip counts, ratio stats.

    ``n`` counts the units the clip fractions and ratio stats are over (tokens; sequences under GSPO, which clips
    sequence ratios), ``n_tokens`` the response tokens ``approx_kl`` is a mean over.
    """

    SUM_KEYS = (
        "loss", "policy_loss", "kl_loss", "clip_low", "clip_high", "dual_clip", "ratio_sum", "approx_kl", "n",
        "n_tokens",
    )  # fmt: skip

    def __init__(self, device):
        self.sums = torch.zeros(len(self.SUM_KEYS), dtype=torch.float64, device=device)
        self.ratio_min = torch.full((1,), float("inf"), dtype=torch.float64, device=device)
        self.ratio_max = torch.full((1,), float("-inf"), dtype=torch.float64, device=device)

    def add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[self.SUM_KEYS.index(key)] += torch.as_tensor(value, dtype=torch.float64).detach()

    def all_reduce_finalize(self) -> dict[str, float]:
        all_reduce_sum(self.sums)
        all_reduce_min_max(self.ratio_min, self.ratio_max)
        s = dict(zip(self.SUM_KEYS, self.sums.tolist(), strict=True))
        n = max(s["n"], 1.0)
        empty = s["n"] == 0
        return {
            "loss": s["loss"],
            "policy_loss": s["policy_loss"],
            "kl_loss": s["kl_loss"],
            "clip_frac_low": s["clip_low"] / n,
            "clip_frac_high": s["clip_high"] / n,
            "dual_clip_frac": s["dual_clip"] / n,
            "ratio_mean": 1.0 if empty else s["ratio_sum"] / n,
            "ratio_min": 1.0 if empty else float(self.ratio_min),
            "ratio_max": 1.0 if empty else float(self.ratio_max),
            "approx_kl": s["approx_kl"] / max(s["n_tokens"], 1.0),
        }


def rl_microbatch_loss(
    logprobs: torch.Tensor,
    pack: Pack,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    algo: AlgoConfig,
    global_tokens: torch.Tensor,
    global_seqs: torch.Tensor,
    max_length: int,
    sums: StepSums,
) -> torch.Tensor:
    """Policy loss (+ kl_coef * KL) of one pack, normalised by the step's global denominators; adds to `sums`."""
    mask = pack.shifted_labels != IGNORE_INDEX
    seq_ids = pack.seq_index
    per_token, _ = POLICY_LOSSES[algo.policy_loss](
        logprobs, old, pack.advantages, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
        clip_ratio_c=algo.clip_ratio_c, is_weights=is_weights, seq_ids=seq_ids,
    )  # fmt: skip
    agg = dict(mode=algo.loss_agg, global_tokens=global_tokens, seq_ids=seq_ids, max_length=max_length,
               global_seqs=global_seqs)  # fmt: skip
    policy_loss = aggregate(per_token, mask, **agg)
    loss = policy_loss
    kl_loss = torch.zeros((), device=logprobs.device)
    if algo.use_kl_loss and ref is not None:
        kl_loss = aggregate(kl_penalty(logprobs, ref, algo.kl_kind), mask, **agg)
        loss = loss + algo.kl_coef * kl_loss
    _add_ratio_stats(sums, logprobs.detach(), old, pack.advantages, mask, algo, seq_ids)
    sums.add("loss", loss)
    sums.add("policy_loss", policy_loss)
    sums.add("kl_loss", kl_loss)
    return loss


def _add_ratio_stats(sums: StepSums, logprobs, old, adv, mask, algo: AlgoConfig, seq_ids=None) -> None:
    """Ratio diagnostics (the clip fractions a user tunes clip ranges by) of what the loss clips: token ratios for
    PPO, sequence ratios with the same clip range for GSPO (``gspo_sequence_stats``)."""
    if not mask.any():
        return
    if algo.policy_loss == "gspo":
        ratio, low, high = gspo_sequence_stats(logprobs, old, adv, mask, algo.clip_low, algo.clip_high, seq_ids)
        sums.add("clip_low", low.sum())
        sums.add("clip_high", high.sum())
    else:
        ratio = torch.exp(torch.clamp(logprobs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[mask].double()
        a = adv[mask]
        sums.add("clip_low", ((a < 0) & (ratio < 1 - algo.clip_low)).sum())
        sums.add("clip_high", ((a > 0) & (ratio > 1 + algo.clip_high)).sum())
        sums.add("dual_clip", ((a < 0) & (ratio > algo.clip_ratio_c)).sum())
    sums.add("ratio_sum", ratio.sum())
    sums.add("n", ratio.numel())
    sums.add("approx_kl", (old - logprobs)[mask].double().sum())  # unclamped, as rlpipe.algos.policy_loss
    sums.add("n_tokens", mask.sum())
    sums.ratio_min = torch.minimum(sums.ratio_min, ratio.min().reshape(1))
    sums.ratio_max = torch.maximum(sums.ratio_max, ratio.max().reshape(1))


def sft_microbatch_loss(logprobs: torch.Tensor, pack: Pack, global_tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of one SFT pack as a share of the step's global token mean."""
    mask = pack.shifted_labels != IGNORE_INDEX
    return -(logprobs * mask).sum() / global_tokens.clamp(min=1.0)
