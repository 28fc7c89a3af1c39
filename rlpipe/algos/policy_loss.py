"""Policy-gradient losses (per token) and the aggregations that turn them into one scalar.

Inputs are token tensors of any shape (usually a 1-D pack ``[L]``): ``logprobs`` (current policy, carries grad),
``old_logprobs`` (policy that the ratio is taken against), ``advantages`` (one value per token, the response's
advantage), ``mask`` (tokens that count), optional ``is_weights`` (rollout importance weights, detached) and
``seq_ids`` (sequence of each token, -1 on padding). Each loss returns ``(per_token_loss, MetricSums)``; the per-token
loss is 0 outside ``mask``. Pass it to ``aggregate``; reduce/merge the metrics over micro-batches and ranks, then
``finalize()`` (see ``rlpipe.algos.metrics``).

Metrics of ``ppo_clip`` (fractions over masked tokens): ``clip_frac_low`` / ``clip_frac_high`` (the clipped branch of the PPO max is
strictly larger, ratio below ``1 - clip_low`` / above ``1 + clip_high``), ``dual_clip_frac`` (A < 0 and the dual clip
``-A * c`` bounds the loss), ``ratio_mean`` / ``ratio_min`` / ``ratio_max``, ``approx_kl`` (k1, mean of old - logp)
and ``approx_kl_k3`` (mean of ``exp(x) - 1 - x``, x = logp - old), both estimates of KL(old || current).
``approx_kl`` is the *unclamped* token mean of ``old - logp`` over masked (response) tokens, the same definition the
trainer logs (``rlpipe.train.objective.StepSums``): the +-20 clamp belongs to the ratio inside the loss, and a metric
on the clamped value would hide an outlier token. ``approx_kl_k3`` uses the clamped x so that ``exp`` stays finite.

``gspo`` clips sequences, not tokens, so its clip and ratio metrics are over *sequences* (``gspo_sequence_stats``,
also what the trainer logs under GSPO): ``clip_frac_low`` / ``clip_frac_high`` = fraction of sequences whose
sequence ratio ``s_i`` is clipped by GSPO's own range (``A_i < 0`` and ``s_i < 1 - clip_low`` / ``A_i > 0`` and
``s_i > 1 + clip_high``: the clipped branch is the larger one, as for PPO), ``ratio_mean/min/max`` over ``s_i``,
``dual_clip_frac`` 0 (GSPO has none); ``approx_kl`` / ``approx_kl_k3`` stay token means.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlpipe.algos.metrics import MetricSums
from rlpipe.algos.registry import lookup
from rlpipe.algos.segments import segments

LOG_RATIO_CLAMP = 20.0


def _where(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values))


def _clipped_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip (+ optional dual clip): ``max(-A r, -A clamp(r, 1-lo, 1+hi))``, then ``min(., -A c)`` where A < 0."""
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    flags = {
        "clip_low": clipped & (ratio < 1.0 - clip_low),
        "clip_high": clipped & (ratio > 1.0 + clip_high),
    }
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        flags["dual_clip"] = dual
    else:
        flags["dual_clip"] = torch.zeros_like(clipped)
    return loss, flags


def _metrics(
    mask: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor, flags: dict[str, torch.Tensor]
) -> MetricSums:
    """Sums and counts over masked tokens (see module doc), detached; ``log_ratio`` is logp - old, *unclamped*."""
    n = mask.sum()
    r = ratio.detach()[mask].double()
    raw = log_ratio.detach()[mask].double()
    lr = torch.clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    m = MetricSums(defaults={"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0})
    m.add_mean("clip_frac_low", flags["clip_low"][mask].sum(), n)
    m.add_mean("clip_frac_high", flags["clip_high"][mask].sum(), n)
    m.add_mean("dual_clip_frac", flags["dual_clip"][mask].sum(), n)
    m.add_mean("ratio_mean", r.sum(), n)
    m.add_min("ratio_min", r)
    m.add_max("ratio_max", r)
    m.add_mean("approx_kl", (-raw).sum(), n)
    m.add_mean("approx_kl_k3", (torch.exp(lr) - 1.0 - lr).sum(), n)
    return m


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricSums]:
    """Token-level PPO clip loss with dual clip ("vanilla" in the seed / verl).

    ``ratio = exp(clamp(logp - old, -20, 20))``; ``L = max(-A ratio, -A clamp(ratio, 1-clip_low, 1+clip_high))``;
    for ``A < 0``: ``L = min(L, -A clip_ratio_c)`` (dual clip, Ye et al. 2020; ``None`` disables it). Rollout IS
    weights multiply ``L``. ``seq_ids`` is unused (uniform signature with ``gspo``).
    """
    mask = mask.bool()
    raw_log_ratio = logprobs - old_logprobs
    ratio = torch.exp(torch.clamp(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, flags = _clipped_loss(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    return _where(mask, loss), _metrics(mask, ratio, raw_log_ratio, flags)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    seq_ids: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, MetricSums]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), GSPO-token form.

    ``s_i = exp(clamp(mean_{t in i} (logp_t - old_t), -20, 20))`` over the masked tokens of sequence ``i``; the token
    ratio ``s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])`` equals ``s_i`` in value but sends the gradient to each token,
    so with ``seq-mean-token-mean`` aggregation and one advantage per sequence the gradient is GSPO's. Clipped like
    PPO with the paper's small ranges (defaults 3e-4 / 4e-4, the paper's values). No dual clip: ``clip_ratio_c`` is
    accepted for a uniform signature and ignored. Sequences come from ``seq_ids`` (or rows of a 2-D tensor).
    Clip and ratio metrics are per sequence (``gspo_sequence_stats``, module doc).
    """
    mask = mask.bool()
    seg = segments(mask, seq_ids)
    token_log_ratio = (logprobs - old_logprobs).detach()
    seq_log_ratio = torch.clamp(seg.mean(token_log_ratio.double()), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_s = seg.broadcast(seq_log_ratio.to(logprobs.dtype), logprobs.shape)
    ratio = torch.exp(log_s) * torch.exp(logprobs - logprobs.detach())
    loss, _ = _clipped_loss(ratio, advantages, clip_low, clip_high, None)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    seq_ratio, low, high = gspo_sequence_stats(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, seq_ids)
    return _where(mask, loss), _gspo_metrics(mask, token_log_ratio, seq_ratio, low, high)


def gspo_sequence_stats(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence, detached float64: ``(s_i, clipped_low_i, clipped_high_i)`` where GSPO's clip is active.

    ``s_i = exp(clamp(mean_t (logp - old), +-20))``; ``A_i`` is the mean advantage of the sequence's masked tokens (one
    value per sequence); low: ``A_i < 0`` and ``s_i < 1 - clip_low``, high: ``A_i > 0`` and ``s_i > 1 + clip_high``.
    The single definition behind ``gspo``'s metrics and the trainer's GSPO step metrics.
    """
    mask = mask.bool()
    seg = segments(mask, seq_ids)
    log_s = seg.mean((logprobs - old_logprobs).detach().double())
    ratio = torch.exp(torch.clamp(log_s, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = seg.mean(advantages.detach().double())
    return ratio, (adv < 0) & (ratio < 1.0 - clip_low), (adv > 0) & (ratio > 1.0 + clip_high)


def _gspo_metrics(
    mask: torch.Tensor,
    token_log_ratio: torch.Tensor,
    seq_ratio: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
) -> MetricSums:
    """Sequence clip/ratio metrics plus the token approx_kl of ``_metrics`` (see module doc)."""
    n_seq = seq_ratio.numel()
    m = MetricSums(defaults={"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0})
    m.add_mean("clip_frac_low", low.sum(), n_seq)
    m.add_mean("clip_frac_high", high.sum(), n_seq)
    m.add_mean("dual_clip_frac", 0.0, n_seq)
    m.add_mean("ratio_mean", seq_ratio.sum(), n_seq)
    m.add_min("ratio_min", seq_ratio)
    m.add_max("ratio_max", seq_ratio)
    n = mask.sum()
    raw = token_log_ratio.detach()[mask].double()
    lr = torch.clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    m.add_mean("approx_kl", (-raw).sum(), n)
    m.add_mean("approx_kl_k3", (torch.exp(lr) - 1.0 - lr).sum(), n)
    return m


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, MetricSums]]] = {
    "vanilla": ppo_clip,
    "ppo_clip": ppo_clip,
    "gspo": gspo,
}

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    global_tokens: torch.Tensor | float | None = None,
    seq_ids: torch.Tensor | None = None,
    max_length: int | None = None,
    global_seqs: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One scalar loss from per-token losses; the denominators are global so micro-batch losses simply add up.

    - ``token-mean``: ``sum(loss * mask) / global_tokens``,
    - ``seq-mean-token-mean``: ``sum_i mean_{t in i} loss / global_seqs``,
    - ``seq-mean-token-sum``: ``sum_i sum_{t in i} loss / global_seqs``,
    - ``seq-mean-token-sum-norm``: ``sum_i sum_{t in i} loss / max_length / global_seqs`` (Dr. GRPO's constant
      normaliser; verl divides by the horizon only, we also average over sequences so the scale does not grow with
      the batch).

    ``global_tokens`` / ``global_seqs`` are the masked-token / sequence counts summed over all ranks and
    micro-batches of the optimizer step (defaults: this call's local counts). Sequences come from ``seq_ids``
    (-1 = padding) or, without it, the rows of a 2-D tensor. An empty mask gives 0, not NaN.
    """
    mask = mask.bool()
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGG_MODES)}")
    dtype, dev = per_token.dtype, per_token.device
    if mode == "token-mean":
        denom = mask.sum() if global_tokens is None else global_tokens
        denom = torch.as_tensor(denom, dtype=dtype, device=dev).clamp(min=1.0)
        return _where(mask, per_token).sum() / denom
    seg = segments(mask, seq_ids)
    denom = seg.num_seqs if global_seqs is None else global_seqs
    denom = torch.as_tensor(denom, dtype=dtype, device=dev).clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        per_seq = seg.mean(per_token)
    else:
        per_seq = seg.sum(per_token)
        if mode == "seq-mean-token-sum-norm":
            if max_length is None or max_length <= 0:
                raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_length > 0")
            per_seq = per_seq / max_length
    return per_seq.sum() / denom


def policy_loss(name: str, *args, **kwargs) -> tuple[torch.Tensor, MetricSums]:
    """``POLICY_LOSSES[name](*args, **kwargs)`` with an error listing known names for a wrong one."""
    return lookup(POLICY_LOSSES, name, "policy loss")(*args, **kwargs)
