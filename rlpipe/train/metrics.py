"""Typed metric records returned by the workers (not loose dicts), and their cross-worker merge."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class TrainStepMetrics:
    """One optimizer step (already reduced over ranks where the value is a global quantity)."""

    step: int
    loss: float
    policy_loss: float
    kl_loss: float
    grad_norm: float
    lr: float
    skipped: bool
    tokens: int  # label tokens of this step over all ranks (the token-mean denominator)
    clip_frac_low: float
    clip_frac_high: float
    dual_clip_frac: float
    ratio_min: float
    ratio_max: float
    ratio_mean: float
    approx_kl: float
    step_time_s: float
    peak_memory_mb: float


@dataclass
class FitMetrics:
    """One RL iteration of `TrainingWorker.fit`."""

    iteration: int
    train_entropy: float
    rollout_entropy: float | None
    kl: float | None  # low_var_kl(old, ref) over all label tokens (the seed's metric), when KL is on
    tokens: int  # label tokens of the whole batch, all ranks
    total_tokens: int  # real tokens (prompt + response) of the whole batch, all ranks
    efficient_attn_ratio: float
    fit_time_s: float
    logprob_time_s: float
    mismatch: dict[str, float] = field(default_factory=dict)
    rollout_is: dict[str, float] = field(default_factory=dict)
    steps: list[TrainStepMetrics] = field(default_factory=list)
    skipped_steps: int = 0

    def summary(self) -> dict[str, float]:
        """Flat row: means over optimizer steps, plus throughput; what metrics.jsonl and the Decks show."""
        row: dict[str, float] = {
            "train_entropy": self.train_entropy,
            "tokens": float(self.tokens),
            "efficient_attn_ratio": self.efficient_attn_ratio,
            "fit_time_s": self.fit_time_s,
            "train_tokens_per_s": self.total_tokens / self.fit_time_s if self.fit_time_s > 0 else 0.0,
            "skipped_steps": float(self.skipped_steps),
        }
        if self.rollout_entropy is not None:
            row["rollout_entropy"] = self.rollout_entropy
        if self.kl is not None:
            row["kl"] = self.kl
        for name in (
            "loss", "policy_loss", "kl_loss", "grad_norm", "lr", "clip_frac_low", "clip_frac_high",
            "dual_clip_frac", "ratio_mean", "approx_kl", "peak_memory_mb",
        ):  # fmt: skip
            values = [getattr(s, name) for s in self.steps]
            if values:
                row[name] = statistics.fmean(values)
        if self.steps:
            row["ratio_min"] = min(s.ratio_min for s in self.steps)
            row["ratio_max"] = max(s.ratio_max for s in self.steps)
        row.update({f"mismatch/{k}": v for k, v in self.mismatch.items()})
        row.update({f"rollout_is/{k}": v for k, v in self.rollout_is.items()})
        return row


@dataclass
class SFTMetrics:
    """One SFT step mixed into RL."""

    loss: float
    grad_norm: float
    skipped: bool
    tokens: int
    efficient_attn_ratio: float
    step_time_s: float
    lr: float

    def summary(self) -> dict[str, float]:
        return {f"sft/{k}": float(v) for k, v in asdict(self).items()}


def merge_worker_metrics(per_rank: list[FitMetrics]) -> FitMetrics:
    """Combine the ranks' records: global values are identical on every rank (reduced in the worker); timings and
    memory are per rank, so take the max (the slowest rank bounds the step), as the seed's merge does."""
    merged = per_rank[0]
    merged.fit_time_s = max(m.fit_time_s for m in per_rank)
    merged.logprob_time_s = max(m.logprob_time_s for m in per_rank)
    for i, step in enumerate(merged.steps):
        step.step_time_s = max(m.steps[i].step_time_s for m in per_rank)
        step.peak_memory_mb = max(m.steps[i].peak_memory_mb for m in per_rank)
    return merged
